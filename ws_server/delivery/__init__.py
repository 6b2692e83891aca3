"""The edge's delivery core (sans-I/O): ``Delivery`` owns every request the edge serves."""

from lanes.ws_server.delivery.actions import (
    Action,
    CancelRequest,
    CheckRequests,
    Finished,
    FirstToken,
    ReadStream,
    Repoint,
    Send,
)
from lanes.ws_server.delivery.core import Delivery
from lanes.ws_server.delivery.entry import DeliveryConfig, Entry, Phase

__all__ = ["Action", "CancelRequest", "CheckRequests", "Delivery", "DeliveryConfig", "Entry", "Finished",
           "FirstToken", "Phase", "ReadStream", "Repoint", "Send"]
