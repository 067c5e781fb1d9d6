"""pdactors: prefill/decode disaggregation for vLLM, as Trio actors.

This module only re-exports the public API; the code lives in the submodules.
"""

from pdactors.actors.bootstrap import serve_bootstrap as serve_bootstrap
from pdactors.actors.receiver import PullResults as PullResults
from pdactors.actors.receiver import Receiver as Receiver
from pdactors.actors.receiver import serve_receiver as serve_receiver
from pdactors.actors.sender import Sender as Sender
from pdactors.actors.sender import SideChannelStats as SideChannelStats
from pdactors.actors.sender import serve_sender as serve_sender
from pdactors.bootstrap_client import BootstrapClient as BootstrapClient
from pdactors.bootstrap_client import open_bootstrap_client as open_bootstrap_client
from pdactors.config import BootstrapConfig as BootstrapConfig
from pdactors.config import DataPlaneConfig as DataPlaneConfig
from pdactors.config import Liveness as Liveness
from pdactors.config import RankInfo as RankInfo
from pdactors.config import ReceiverConfig as ReceiverConfig
from pdactors.config import SenderConfig as SenderConfig
from pdactors.dataplane import DataPlane as DataPlane
from pdactors.dataplane import MooncakeDataPlane as MooncakeDataPlane
from pdactors.dataplane import RunHasher as RunHasher
from pdactors.dataplane import Xxh3Hasher as Xxh3Hasher
from pdactors.dataplane import open_mooncake as open_mooncake
from pdactors.errors import BadBlockIds as BadBlockIds
from pdactors.errors import BadMessage as BadMessage
from pdactors.errors import BadTransferParams as BadTransferParams
from pdactors.errors import BootstrapError as BootstrapError
from pdactors.errors import ConfigError as ConfigError
from pdactors.errors import DataPlaneError as DataPlaneError
from pdactors.errors import DuplicateTransfer as DuplicateTransfer
from pdactors.errors import IllegalTransition as IllegalTransition
from pdactors.errors import LayoutMismatch as LayoutMismatch
from pdactors.errors import PdError as PdError
from pdactors.errors import PlanError as PlanError
from pdactors.errors import PullFailedError as PullFailedError
from pdactors.errors import TransferError as TransferError
from pdactors.proxy import serve_proxy as serve_proxy
from pdactors.proxy_config import PrefillBackend as PrefillBackend
from pdactors.proxy_config import ProxyConfig as ProxyConfig
from pdactors.wire import BlockLayout as BlockLayout
from pdactors.wire import Compat as Compat
from pdactors.wire import KVTransferParams as KVTransferParams
from pdactors.wire import Layout as Layout

__version__ = "0.1.0"
