"""gear client: `import gear_client as reverb` for code written against Reverb."""

__version__ = "0.1.0"
