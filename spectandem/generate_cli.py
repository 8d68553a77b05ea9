"""`spectandem generate` (filled in below)."""


def add_generate(sub) -> None:
    return None
