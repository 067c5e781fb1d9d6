"""The deployment tooling: ``pdactors launch`` (a whole P/D deployment as supervised child
processes on one machine, with a smoke check) and ``--render k8s`` (the same TOML as Kubernetes
manifests). Nothing in the library imports it but ``pdactors.cli``.

This module only re-exports; the code lives in the submodules, read in this order:
``launch_config`` and ``k8s_config`` (the TOML file's schema), ``credentials`` (a secure run's
secrets), ``plan`` (what to start), ``supervise`` (running and stopping it), ``stats`` (figures
from ``/metrics``), ``view`` (the terminal), ``smoke`` (the smoke check), ``command`` (the
``launch`` command's options and flow), ``k8s`` (the manifests).
"""

from pdactors.deploy.command import launch_command as launch_command
from pdactors.deploy.credentials import RunSecrets as RunSecrets
from pdactors.deploy.credentials import is_loopback as is_loopback
from pdactors.deploy.credentials import make_secrets as make_secrets
from pdactors.deploy.errors import BadDeployConfig as BadDeployConfig
from pdactors.deploy.errors import ChildDied as ChildDied
from pdactors.deploy.errors import DeployError as DeployError
from pdactors.deploy.errors import ModelBuildFailed as ModelBuildFailed
from pdactors.deploy.errors import NotHealthy as NotHealthy
from pdactors.deploy.errors import UnsafeSecretsDir as UnsafeSecretsDir
from pdactors.deploy.k8s import render_k8s as render_k8s
from pdactors.deploy.k8s import write_manifests as write_manifests
from pdactors.deploy.k8s_config import K8sConfig as K8sConfig
from pdactors.deploy.launch_config import LaunchConfig as LaunchConfig
from pdactors.deploy.plan import Child as Child
from pdactors.deploy.plan import Plan as Plan
from pdactors.deploy.plan import plan_deployment as plan_deployment
from pdactors.deploy.smoke import Smoke as Smoke
from pdactors.deploy.stats import Stats as Stats
from pdactors.deploy.stats import metric_total as metric_total
from pdactors.deploy.supervise import launch as launch
from pdactors.deploy.supervise import log_tail as log_tail
from pdactors.deploy.view import LaunchView as LaunchView
