# What type checkers see of the package: the names __init__.py imports on first use.
from streamck.api import build_plan as build_plan
from streamck.api import diff as diff
from streamck.api import export_eagle4_draft as export_eagle4_draft
from streamck.api import hash as hash
from streamck.api import ls as ls
from streamck.api import rewrite as rewrite
from streamck.errors import CheckpointError as CheckpointError
from streamck.errors import DeviceError as DeviceError
from streamck.errors import OutputError as OutputError
from streamck.errors import PlanError as PlanError
from streamck.errors import StreamckError as StreamckError
from streamck.errors import UsageError as UsageError
from streamck.manifest import checkpoint_manifest as checkpoint_manifest
from streamck.manifest import plan_manifest as plan_manifest
from streamck.plan import OutputTensor as OutputTensor
from streamck.plan import Plan as Plan
from streamck.plan import Rule as Rule
from streamck.plan import Rules as Rules
from streamck.plan import compile_plan as compile_plan
from streamck.plan import eagle3_plan as eagle3_plan
from streamck.plan import eagle3_speculators_plan as eagle3_speculators_plan
from streamck.plan import eagle4_plan as eagle4_plan
from streamck.plan import load_rules as load_rules
from streamck.plan import megatron_plan as megatron_plan
from streamck.plan import olmo2_plan as olmo2_plan
from streamck.plan import torchtitan_plan as torchtitan_plan
from streamck.plan.options import PlanOptions as PlanOptions
from streamck.source import Checkpoint as Checkpoint
from streamck.source import TensorRef as TensorRef
from streamck.source import open_checkpoint as open_checkpoint
from streamck.spec import SourceSpec as SourceSpec
from streamck.writer import WriteOptions as WriteOptions
from streamck.writer import WriteResult as WriteResult
from streamck.writer import write_plan as write_plan

__version__: str
