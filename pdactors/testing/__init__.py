"""Test and benchmark support: the standalone harness and fault-injection wrappers."""

from pdactors.testing.cluster import Cluster as Cluster
from pdactors.testing.cluster import DecodeNode as DecodeNode
from pdactors.testing.cluster import PrefillNode as PrefillNode
from pdactors.testing.cluster import TransferOutcome as TransferOutcome
from pdactors.testing.cluster import open_cluster as open_cluster
from pdactors.testing.cluster import run_transfer as run_transfer
from pdactors.testing.faults import FaultyDataPlane as FaultyDataPlane
from pdactors.testing.faults import FaultyTransport as FaultyTransport
from pdactors.testing.faults import MessageFaults as MessageFaults
from pdactors.testing.harness import HarnessReport as HarnessReport
from pdactors.testing.harness import run_harness as run_harness
from pdactors.testing.kv import BlockPool as BlockPool
from pdactors.testing.kv import KVBuffer as KVBuffer
