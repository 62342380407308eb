"""The InferenceWorker gRPC servicer: parse, hand the engine its work, build the reply."""

from __future__ import annotations

import queue
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict
from functools import partial

import grpc

from agentkv import auth
from agentkv.errors import InvalidArgument
from agentkv.worker.v1 import worker_pb2 as pb
from agentkv.worker.v1 import worker_pb2_grpc
from inference_worker.conversation import ChatMessage, check_said
from inference_worker.front import Front
from inference_worker.grammar import Ask, OutputForm
from inference_worker.sampling import Sampling
from inference_worker.tools import canonical_tools, checked_calls
from inference_worker.turns import END, AgentInfo, StartEvent, TokenEvent, TurnJob

SERVICE_NAME = "agentkv.worker.v1.InferenceWorker"
# GetWorkerInfoResponse.features: what an older worker lacks
FEATURES = ("after_mark", "tool_call_allowed", "keep_named_marks", "durable_create")
MAX_REQUEST_ID = 64
MAX_MARK = 64  # characters of an after_mark (a Usage.mark is 24)
# no ',', ';' or space: metadata._extras joins names with them
MARK_NAME = re.compile(r"[A-Za-z0-9_-]{1,16}")


class InferenceWorkerServicer(worker_pb2_grpc.InferenceWorkerServicer):
    def __init__(self, front: Front, info: dict) -> None:
        self.front = front
        self.engine = front.engine
        self.info = info  # static facts: model, fingerprint, kv format, device, blas...

    def CreateAgent(self, request: pb.CreateAgentRequest, context) -> pb.CreateAgentResponse:
        auth.check_namespace(request.namespace)
        ns, agent_id, phase = request.namespace, request.agent_id, request.phase
        job = TurnJob(ns, agent_id, [], Sampling(max_tokens=0), phase, creates=True)
        job.tools, job.durable = canonical_tools(request.tools), request.durable
        self.engine.grammars.warm(job.tools)  # strict tools: compiled here, not at a turn
        create = partial(
            self.front.create_agent, system=request.system_prompt, metadata=dict(request.metadata)
        )
        usage = None
        for response in self._run(job, context, create):
            usage = response.usage
        return pb.CreateAgentResponse(agent=_state(self.front.describe(ns, agent_id)), usage=usage)

    def Turn(
        self, request: pb.TurnRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.TurnResponse]:
        auth.check_namespace(request.namespace)
        s = request.sampling
        seed = s.seed if s.HasField("seed") else None
        sampling = Sampling(
            s.temperature, s.top_p, s.top_k, s.max_tokens, list(s.stop), seed, s.fit_max_tokens
        )
        checked = sampling.validate(
            self.engine.config.max_stop_strings, self.engine.runtime.vocab_size
        )
        job = self._job(request, checked)
        job.tools = canonical_tools(request.tools)
        job.max_tool_calls = request.max_tool_calls
        job.whole_conversation = request.whole_conversation
        known = None if job.own_tools else job.tools  # the agent's: known at the turn's start
        ask = Ask(
            _form(request),
            request.tool_call_required,
            request.tool_call_name,
            request.tool_call_forbidden,
            tuple(request.tool_call_allowed),
        )
        job.forms = self.engine.grammars.forms(ask, known, request.tools if job.tools else "")
        if job.forms is not None and job.forms.ask.holds_form and checked.stop:
            raise InvalidArgument("stop strings would cut the reply's required form short")
        self.engine.chat.check_tools(job.tools, job.messages)
        job.after_mark, job.after_mark_last = request.after_mark, request.after_mark_last
        job.mark_name, job.keep_named_marks = request.mark_name, request.keep_named_marks
        _check_mark(job)
        job.request_id = _request_id(request)
        if not job.whole_conversation:
            check_said(job.messages)
        yield from self._run(job, context)

    def InjectContext(
        self, request: pb.InjectContextRequest, context: grpc.ServicerContext
    ) -> pb.InjectContextResponse:
        auth.check_namespace(request.namespace)
        if not request.messages:
            raise InvalidArgument("InjectContext needs at least one message")
        job = self._job(request, Sampling(max_tokens=0))
        check_said(job.messages)
        self.engine.chat.check_tools("", job.messages)
        job.request_id = _request_id(request)
        usage = None
        for response in self._run(job, context):
            usage = response.usage
        agent = self.front.describe(request.namespace, request.agent_id)
        return pb.InjectContextResponse(agent=_state(agent), usage=usage)

    def ForkAgent(self, request: pb.ForkAgentRequest, context) -> pb.ForkAgentResponse:
        auth.check_namespace(request.namespace)
        info = self.front.fork(
            request.namespace,
            request.source_agent_id,
            request.agent_id,
            request.phase,
            _request_id(request),
        )
        return pb.ForkAgentResponse(agent=_state(info))

    @staticmethod
    def _job(request: pb.TurnRequest | pb.InjectContextRequest, sampling: Sampling) -> TurnJob:
        return TurnJob(
            request.namespace,
            request.agent_id,
            [_message(m) for m in request.messages],
            sampling,
            request.phase,
            priority=request.priority,
            deadline_ms=request.deadline_ms,
            durable=request.durable,
        )

    def _run(
        self,
        job: TurnJob,
        context: grpc.ServicerContext,
        start: Callable[[TurnJob], None] | None = None,
    ) -> Iterator[pb.TurnResponse]:
        """Starts the job on the engine (a turn, unless `start` says otherwise) and streams
        its events until it ends."""
        # A client that goes away frees its slot; one gone already never holds one.
        if not context.add_callback(job.cancelled.set):
            job.cancelled.set()
        (start or self.front.start_turn)(job)  # raises what refused it
        pending = None  # what came after a run of token events
        while (event := pending or _next_event(job, context)) is not END:
            pending = None
            if isinstance(event, TokenEvent):
                # Tokens queued while the stream was busy go out as one chunk.
                text, ids, calls = [event.text], list(event.token_ids), list(event.calls)
                while pending is None and not job.events.empty():
                    more = job.events.get_nowait()
                    if isinstance(more, TokenEvent):
                        text.append(more.text)
                        ids += more.token_ids
                        calls += more.calls
                    else:
                        pending = more
                # Marked before it goes: a caller may read it and leave before gRPC asks for
                # more. A call already over sends nothing (its caller was told it failed).
                job.streamed = job.streamed or context.is_active()
                if ids or any(text) or not calls:
                    yield pb.TurnResponse(tokens=pb.TokenChunk(text="".join(text), token_ids=ids))
                for c in calls:
                    call = pb.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                    yield pb.TurnResponse(tool_call=call)
            elif isinstance(event, StartEvent):
                yield pb.TurnResponse(started=pb.Usage(**asdict(event.usage)))
            else:
                yield pb.TurnResponse(usage=pb.Usage(**asdict(event)))
        if job.error is not None:
            raise job.error

    def EvictAgent(self, request: pb.EvictAgentRequest, context) -> pb.EvictAgentResponse:
        auth.check_namespace(request.namespace)
        evicted, freed = self.front.evict(request.namespace, request.agent_id)
        return pb.EvictAgentResponse(evicted=evicted, bytes_freed=freed)

    def DescribeAgent(self, request: pb.DescribeAgentRequest, context) -> pb.DescribeAgentResponse:
        auth.check_namespace(request.namespace)
        info = self.front.describe(request.namespace, request.agent_id)
        return pb.DescribeAgentResponse(agent=_state(info))

    def DeleteAgent(self, request: pb.DeleteAgentRequest, context) -> pb.DeleteAgentResponse:
        auth.check_namespace(request.namespace)
        deleted = self.front.delete(request.namespace, request.agent_id)
        return pb.DeleteAgentResponse(deleted=deleted)

    def PinAgent(self, request: pb.PinAgentRequest, context) -> pb.PinAgentResponse:
        auth.check_namespace(request.namespace)
        info = self.front.pin(request.namespace, request.agent_id, request.pinned)
        return pb.PinAgentResponse(agent=_state(info))

    def CountTokens(self, request: pb.CountTokensRequest, context) -> pb.CountTokensResponse:
        messages = [_message(m) for m in request.messages]
        count = self.front.count_tokens(messages, canonical_tools(request.tools))
        return pb.CountTokensResponse(prompt_tokens=count)

    def GetWorkerInfo(self, request: pb.GetWorkerInfoRequest, context) -> pb.GetWorkerInfoResponse:
        caller = auth.current()  # a token of some namespaces sees their agents' figures
        budget, used, count = self.front.hot_tier(caller.namespaces if caller else None)
        return pb.GetWorkerInfoResponse(
            **self.info, hot_budget_bytes=budget, hot_bytes=used, num_hot_agents=count
        )


def _next_event(job: TurnJob, context: grpc.ServicerContext) -> object:
    """The job's next event, or END once the RPC is over (cancelled by its client or by the
    server's stop): no RPC thread waits for a turn that nobody will read or finish."""
    while True:
        try:
            return job.events.get(timeout=1.0)
        except queue.Empty:
            if not context.is_active():
                return END


def _message(m: pb.Message) -> ChatMessage:
    calls = checked_calls([(c.id, c.name, c.arguments) for c in m.tool_calls])
    return ChatMessage(m.role, m.content, calls, m.tool_call_id)


def _state(info: AgentInfo) -> pb.AgentState:
    return pb.AgentState(**asdict(info))


def _request_id(
    request: pb.TurnRequest | pb.InjectContextRequest | pb.ForkAgentRequest,
) -> str:
    """The call's idempotency key, checked."""
    if len(request.request_id) > MAX_REQUEST_ID:
        raise InvalidArgument(
            f"request_id of {len(request.request_id)} characters is over {MAX_REQUEST_ID}"
        )
    return request.request_id


def _form(request: pb.TurnRequest) -> OutputForm | None:
    """The reply's required form, if the request sets one."""
    kind = request.format.WhichOneof("kind") if request.HasField("format") else None
    if kind is None:
        return None
    if kind == "json_object" and not request.format.json_object:
        raise InvalidArgument("format json_object must be true when set")
    return OutputForm(kind, "" if kind == "json_object" else getattr(request.format, kind))


def _check_mark(job: TurnJob) -> None:
    """Refuses an after_mark that no turn reports (a mark is 24 characters), or one that
    comes with a resent conversation (which finds its own point)."""
    if len(job.after_mark) > MAX_MARK:
        raise InvalidArgument(f"after_mark is a turn's Usage.mark, at most {MAX_MARK} characters")
    if job.mark_name and not MARK_NAME.fullmatch(job.mark_name):
        raise InvalidArgument(
            f"mark_name {job.mark_name[:40]!r} is not 1 to 16 letters, digits, '_' or '-'"
        )
    if job.after_mark_last and not job.after_mark:
        raise InvalidArgument("after_mark_last needs an after_mark")
    if job.keep_named_marks and not job.whole_conversation:
        raise InvalidArgument("keep_named_marks is for a resent whole_conversation")
    if job.after_mark and job.whole_conversation:
        raise InvalidArgument("after_mark continues a conversation; whole_conversation resends it")
