"""Client-side tests: nests, specs, errors, writers."""
