"""The agentkv SDK, imported as `agentkv.client` (its folder is client/):

    from agentkv.client import AgentMemory, Workflow, Role

agents routed across workers (AgentMemory, and AsyncAgentMemory for asyncio), workflows
with cross-phase injection, and the low-level StoreClient and WorkerClient. Errors are
agentkv.errors' classes; a reply cut off by its worker's end raises ReplyCutOff, an
Unavailable that says after how many tokens.
"""

from agentkv.channels import ClientSecurity
from agentkv.client.aio import AsyncAgentMemory
from agentkv.client.memory import AgentMemory
from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.client.worker_core import ReplyCutOff
from agentkv.client.workflow import Role, Workflow

__all__ = [
    "AgentMemory",
    "AsyncAgentMemory",
    "ClientSecurity",
    "ReplyCutOff",
    "Role",
    "StoreClient",
    "WorkerClient",
    "Workflow",
]
