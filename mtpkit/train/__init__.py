"""Training and measuring MTP heads."""
