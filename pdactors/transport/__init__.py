"""The side channel: a small :class:`Transport` seam, trio ⇄ ZMQ ROUTER/DEALER (the default), and
an in-memory transport for tests."""

from pdactors.transport.base import ZMQ as ZMQ
from pdactors.transport.base import Dealer as Dealer
from pdactors.transport.base import Router as Router
from pdactors.transport.base import Transport as Transport
from pdactors.transport.base import ZmqTransport as ZmqTransport
from pdactors.transport.memory import MemoryTransport as MemoryTransport
from pdactors.transport.zmq import DealerSocket as DealerSocket
from pdactors.transport.zmq import PeerUnreachable as PeerUnreachable
from pdactors.transport.zmq import RouterSocket as RouterSocket
from pdactors.transport.zmq import TransportError as TransportError
from pdactors.transport.zmq import open_dealer as open_dealer
from pdactors.transport.zmq import open_router as open_router
