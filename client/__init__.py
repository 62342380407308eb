"""The agentkv SDK, imported as `agentkv.client` (its folder is client/):

    from agentkv.client import AgentMemory, Workflow, Role

agents routed across workers (AgentMemory, and AsyncAgentMemory for asyncio), workflows
with cross-phase injection, and the low-level StoreClient and WorkerClient.
"""

from agentkv.channels import ClientSecurity
from agentkv.client.aio import AsyncAgentMemory
from agentkv.client.memory import AgentMemory
from agentkv.client.store import StoreClient
from agentkv.client.worker import WorkerClient
from agentkv.client.workflow import Role, Workflow

__all__ = [
    "AgentMemory",
    "AsyncAgentMemory",
    "ClientSecurity",
    "Role",
    "StoreClient",
    "WorkerClient",
    "Workflow",
]
