"""Generated from proto/spectandem/v1 by `python -m spectandem.genproto`; do not edit."""
