"""Fedge's message protocol, shared by the coordinator and the edge client (see ``records``)."""

from protocol.records import *
from protocol.records import __all__  # noqa: F401
