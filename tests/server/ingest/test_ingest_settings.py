"""The [ingest] config section: parsed by its own module, every mistake named."""

from __future__ import annotations

import pytest

from gear_server.config import ConfigError, parse_config

TABLE = {"tables": [{"name": "t", "max_size": 10, "preset": "queue"}]}


def test_the_ingest_section_is_parsed():
    settings = parse_config({**TABLE, "ingest": {"workers": 3, "reservation_timeout_s": 5,
                                                 "max_reservations_per_stream": 32}})
    assert (settings.ingest.workers, settings.ingest.reservation_timeout_s,
            settings.ingest.max_reservations_per_stream, settings.ingest.insert_plane) == (3, 5.0, 32, True)


@pytest.mark.parametrize(("section", "words"), [
    ({"workers": -1}, "workers"),
    ({"workers": "4"}, "workers"),
    ({"reservation_timeout_s": 0}, "reservation_timeout_s"),
    ({"max_reservations_per_stream": 0}, "max_reservations_per_stream"),
    ({"workers": 2, "insert_plane": False}, "insert_plane"),
    ({"wrokers": 2}, "wrokers"),
])
def test_mistakes_name_the_key(section, words):
    with pytest.raises(ConfigError, match=words):
        parse_config({**TABLE, "ingest": section})
