"""Every wire type of pdactors, in one package: import them from here.

* **Side-channel messages** (D ⇄ P over ZMQ ROUTER/DEALER), msgpack-encoded tagged Structs
  (:mod:`~pdactors.wire.side_channel`), within the limits of :mod:`~pdactors.wire.limits`, and
  the KV memory they describe (:mod:`~pdactors.wire.layout`).
* **Compatibility descriptions** (:class:`~pdactors.wire.Compat`): what must match between P
  and D, in P's registration and D's pulls (:mod:`~pdactors.wire.compat`).
* **Bootstrap bodies** (JSON over HTTP), in the same shapes as upstream vLLM's Mooncake
  bootstrap server, so upstream proxies and tools can talk to ours
  (:mod:`~pdactors.wire.bootstrap`).
* **kv_transfer_params keys**, the dictionary vLLM carries per request between the proxy, P
  and D (:mod:`~pdactors.wire.kv_params`).
"""

from pdactors.wire.bootstrap import BootstrapAnswer as BootstrapAnswer
from pdactors.wire.bootstrap import BootstrapEntry as BootstrapEntry
from pdactors.wire.bootstrap import RegisterWorker as RegisterWorker
from pdactors.wire.bootstrap import is_curve_key as is_curve_key
from pdactors.wire.compat import COMPAT_INFO as COMPAT_INFO
from pdactors.wire.compat import Compat as Compat
from pdactors.wire.kv_params import KVTransferParams as KVTransferParams
from pdactors.wire.layout import BlockIds as BlockIds
from pdactors.wire.layout import BlockIdsLike as BlockIdsLike
from pdactors.wire.layout import BlockLayout as BlockLayout
from pdactors.wire.layout import Layout as Layout
from pdactors.wire.layout import WireBlockIds as WireBlockIds
from pdactors.wire.layout import block_groups as block_groups
from pdactors.wire.layout import layout_id as layout_id
from pdactors.wire.layout import region_groups as region_groups
from pdactors.wire.limits import LIMITS as LIMITS
from pdactors.wire.limits import MAX_BLOCK_IDS as MAX_BLOCK_IDS
from pdactors.wire.limits import MAX_BLOCK_SIZE as MAX_BLOCK_SIZE
from pdactors.wire.limits import MAX_COMPAT_FIELD as MAX_COMPAT_FIELD
from pdactors.wire.limits import MAX_FRAME_BYTES as MAX_FRAME_BYTES
from pdactors.wire.limits import MAX_GROUPS as MAX_GROUPS
from pdactors.wire.limits import MAX_ID as MAX_ID
from pdactors.wire.limits import MAX_KV_HEADS as MAX_KV_HEADS
from pdactors.wire.limits import MAX_NAME as MAX_NAME
from pdactors.wire.limits import MAX_PP_SIZE as MAX_PP_SIZE
from pdactors.wire.limits import MAX_REASON as MAX_REASON
from pdactors.wire.limits import MAX_REGIONS as MAX_REGIONS
from pdactors.wire.limits import MAX_SUM_BYTES as MAX_SUM_BYTES
from pdactors.wire.limits import MAX_SUM_RUNS as MAX_SUM_RUNS
from pdactors.wire.limits import MAX_TP_SIZE as MAX_TP_SIZE
from pdactors.wire.side_channel import HEADER as HEADER
from pdactors.wire.side_channel import PROTOCOL_VERSION as PROTOCOL_VERSION
from pdactors.wire.side_channel import CancelPull as CancelPull
from pdactors.wire.side_channel import ErrorReply as ErrorReply
from pdactors.wire.side_channel import FrameError as FrameError
from pdactors.wire.side_channel import LayoutUnknown as LayoutUnknown
from pdactors.wire.side_channel import Msg as Msg
from pdactors.wire.side_channel import PullDone as PullDone
from pdactors.wire.side_channel import PullFailed as PullFailed
from pdactors.wire.side_channel import PullRequest as PullRequest
from pdactors.wire.side_channel import Writing as Writing
from pdactors.wire.side_channel import decode_frames as decode_frames
from pdactors.wire.side_channel import encode_frames as encode_frames
