"""The data plane: moves KV bytes from P's memory into D's memory."""

from pdactors.dataplane.base import DataPlane as DataPlane
from pdactors.dataplane.checksum import RunHasher as RunHasher
from pdactors.dataplane.checksum import Xxh3Hasher as Xxh3Hasher
from pdactors.dataplane.engine import open_mooncake as open_mooncake
from pdactors.dataplane.mooncake import MooncakeDataPlane as MooncakeDataPlane
