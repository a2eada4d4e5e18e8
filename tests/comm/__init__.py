"""Tests of the communication layer, ``tensorplay.distributed._comm``: one process and multi-rank."""
