"""Test doubles that behave like real pdserve processes."""
