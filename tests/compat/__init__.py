"""Reverb-compatibility suite: Reverb user code run against `import gear_client as reverb`."""
