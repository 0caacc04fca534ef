"""Fedge's message protocol, shared by the coordinator and the edge client (see ``records``)."""

from fedge.protocol.records import *
from fedge.protocol.records import __all__  # noqa: F401
