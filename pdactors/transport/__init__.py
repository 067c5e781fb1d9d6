"""trio ⇄ ZMQ transport: ROUTER (P's side channel) and DEALER (D's connection to one P worker)."""

from pdactors.transport.zmq import DealerSocket as DealerSocket
from pdactors.transport.zmq import PeerUnreachable as PeerUnreachable
from pdactors.transport.zmq import RouterSocket as RouterSocket
from pdactors.transport.zmq import TransportError as TransportError
from pdactors.transport.zmq import open_dealer as open_dealer
from pdactors.transport.zmq import open_router as open_router
