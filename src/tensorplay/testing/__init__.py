"""Testing utilities: :mod:`tensorplay.testing.distributed` runs code on local ranks."""
