"""Readable reference trainers that pull experience from the buffer and publish weights."""
