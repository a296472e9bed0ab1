"""Every error sessiontape raises on purpose.

One root, named after the condition. Transports translate these into their
wire (gRPC status, HTTP status + JSON body, D4 ``err``) in exactly one place
each; ``code`` is the stable machine-readable name they all share.

    SessiontapeError
    ├── NotFound
    │   ├── SessionNotFound          unknown or purged session
    │   ├── SessionExpired           idle TTL ran out (reported as not found)
    │   ├── NodeNotFound
    │   └── TargetNotFound           unknown Evergreen target_spec id
    ├── InvalidArgument
    │   ├── InvalidFragment          malformed Evergreen fragment
    │   ├── InvalidAction
    │   ├── TokenOutOfVocabulary
    │   ├── InvalidRange
    │   ├── InvalidImage             wrong pad run, or engine takes no images
    │   ├── InvalidParameters        bad sampling parameters
    │   ├── InvalidConstraint        a JSON Schema, regex or grammar llguidance refuses
    │   ├── InvalidTool              a bad tool name or spec, two of a name, a choice naming none
    │   ├── InvalidValue             a value JSON cannot store exactly (NaN, >64-bit int, lone surrogate)
    │   └── InvalidPatch             a malformed or failing JSON Patch+ document
    ├── FailedPrecondition
    │   ├── OffsetMismatch           Salience offset drift
    │   ├── ImageBlockSplit          fork or truncation inside an image block
    │   ├── AppendOnlyViolation      rewinding a Kakeya session
    │   ├── ModelMismatch            the client expects another served model
    │   ├── SessionClosed            the session is closed or aborted
    │   ├── ProtocolViolation        Evergreen abort rules
    │   └── CacheInvariantViolation  Kakeya INV-1 / INV-2
    ├── ResourceExhausted
    │   ├── ContextOverflow
    │   └── EngineBusy               no KV slot came free in time (all held by generating sessions)
    ├── Aborted
    │   ├── SessionBusy              one writer per session at a time
    │   └── ConcurrencyError         stale expected version on append
    ├── Unauthenticated
    ├── ChainBroken                  the hash chain does not verify
    ├── InvalidEvent                 a stored event the fold cannot apply (a corrupt log)
    ├── LogClosed                    the event log is shutting down
    ├── LogUnavailable               the database went away or stays locked
    ├── DatabaseInUse                another server serves this SQLite file
    ├── ConfigError
    │   ├── PluginNotFound           no engine/transport of that name
    │   └── UnsupportedModel         a model source the importer cannot serve faithfully
    └── EngineError                  the engine failed
"""

from __future__ import annotations

#: The most bytes (UTF-8) of an error's message: every wire echoes it (a gRPC
#: ``grpc-message`` header, an HTTP JSON body, a D4 ``err``), so a client's oversized
#: value can never make an answer large or slow to encode.
MAX_MESSAGE_BYTES = 1024
#: A client's value longer than this is described (``session_id of 1,000,000
#: characters``), not quoted, in a message.
MAX_QUOTED_CHARS = 80


def shown(value: object, name: str = "value") -> str:
    """``value`` as an error message quotes it: its ``repr`` when short, else what it is
    and how long (``session_id of 1,000,000 characters``), never the whole of it."""
    if isinstance(value, str | bytes | bytearray) and len(value) > MAX_QUOTED_CHARS:
        unit = "characters" if isinstance(value, str) else "bytes"
        return f"{name} of {len(value):,} {unit}"
    text = repr(value)
    if len(text) > MAX_QUOTED_CHARS:
        return f"{name} ({type(value).__name__}, {len(text):,} characters as text)"
    return text


def bounded(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """``message`` cut to at most ``limit`` UTF-8 bytes, saying how much was left out."""
    data = message.encode("utf-8", "surrogatepass")
    if len(data) <= limit:
        return message
    head = data[: limit - 48].decode("utf-8", "ignore")
    kept = len(head.encode("utf-8", "surrogatepass"))
    return f"{head}... ({len(data) - kept:,} bytes elided)"


class SessiontapeError(Exception):
    """Root of every error sessiontape raises on purpose. Its message is bounded
    (:data:`MAX_MESSAGE_BYTES`), whatever a client's values made it."""

    code: str = "internal"

    def __init__(self, message: str) -> None:
        message = bounded(message)
        super().__init__(message)
        self.message = message


class NotFound(SessiontapeError):
    code = "not_found"


class SessionNotFound(NotFound):
    code = "session_not_found"

    def __init__(self, session_id: str) -> None:
        super().__init__(f"session {shown(session_id, 'session_id')} not found")
        self.session_id = session_id


class SessionExpired(NotFound):
    code = "session_expired"

    def __init__(self, session_id: str) -> None:
        SessiontapeError.__init__(
            self, f"session {shown(session_id, 'session_id')} expired (idle TTL)"
        )
        self.session_id = session_id


class NodeNotFound(NotFound):
    code = "node_not_found"


class TargetNotFound(NotFound):
    code = "target_not_found"


class InvalidArgument(SessiontapeError):
    code = "invalid_argument"


class InvalidFragment(InvalidArgument):
    code = "invalid_fragment"


class InvalidAction(InvalidArgument):
    code = "invalid_action"


class TokenOutOfVocabulary(InvalidArgument):
    code = "token_out_of_vocabulary"


class InvalidRange(InvalidArgument):
    code = "invalid_range"


class InvalidImage(InvalidArgument):
    code = "invalid_image"


class InvalidParameters(InvalidArgument):
    code = "invalid_parameters"


class InvalidConstraint(InvalidArgument):
    """A generation's constraint (JSON Schema, regex, grammar) that cannot be applied:
    malformed, outside what llguidance supports, or not matched by the history it is
    asked to continue."""

    code = "invalid_constraint"


class InvalidTool(InvalidArgument):
    """A tool a model cannot be given: a name outside ``[A-Za-z0-9_-]{1,64}``, parameters
    that are not a JSON Schema object, two tools of one name, a spec of an unknown shape,
    or a ``tool_choice`` naming no tool (a schema llguidance refuses is InvalidConstraint)."""

    code = "invalid_tool"


class InvalidValue(InvalidArgument):
    """A value the log refuses to store: a non-finite float, an integer beyond
    64 bits, a string that is not valid Unicode, or nesting deeper than the
    encoder allows. Raised before anything is written."""

    code = "invalid_value"


class InvalidEvent(SessiontapeError):
    """An event that cannot follow the state before it: the log, not the
    client, is at fault (or an import file is not what it claims)."""

    code = "invalid_event"


class InvalidPatch(InvalidArgument):
    code = "invalid_patch"


class FailedPrecondition(SessiontapeError):
    code = "failed_precondition"


class OffsetMismatch(FailedPrecondition):
    code = "offset_mismatch"


class ImageBlockSplit(FailedPrecondition):
    code = "image_block_split"


class AppendOnlyViolation(FailedPrecondition):
    code = "append_only"


class ModelMismatch(FailedPrecondition):
    """The client names a model other than the one this server serves."""

    code = "model_mismatch"


class SessionClosed(FailedPrecondition):
    code = "session_closed"


class ProtocolViolation(FailedPrecondition):
    code = "protocol_violation"


class CacheInvariantViolation(FailedPrecondition):
    code = "cache_invariant_violation"


class ResourceExhausted(SessiontapeError):
    code = "resource_exhausted"


class EngineBusy(ResourceExhausted):
    """Every KV slot of a batching engine is held by a generating session, past the wait bound."""

    code = "engine_busy"


class ContextOverflow(ResourceExhausted):
    code = "context_overflow"


class Aborted(SessiontapeError):
    code = "aborted"


class SessionBusy(Aborted):
    code = "session_busy"

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {shown(session_id, 'session_id')} is busy (one writer at a time)"
        )
        self.session_id = session_id


class ConcurrencyError(Aborted):
    """An append carried a stale expected version; nothing was written."""

    code = "concurrency_conflict"


class Unauthenticated(SessiontapeError):
    code = "unauthenticated"


class ChainBroken(SessiontapeError):
    code = "chain_broken"


class LogClosed(SessiontapeError):
    code = "log_closed"


class LogUnavailable(SessiontapeError):
    """The database cannot be reached or is locked: try again later (nothing was written)."""

    code = "log_unavailable"
    #: seconds a client should wait before retrying (HTTP ``Retry-After``)
    retry_after_s = 1


class DatabaseInUse(SessiontapeError):
    """Another ``sessiontape serve`` holds this SQLite file (one server per file)."""

    code = "database_in_use"


class ConfigError(SessiontapeError):
    code = "config_error"


class PluginNotFound(ConfigError):
    code = "plugin_not_found"


class UnsupportedModel(ConfigError):
    """A model source whose architecture, tokenizer or weight format the importer does not serve.

    Raised instead of building a model that would compute something else; the
    message names what is unsupported.
    """

    code = "unsupported_model"


class EngineError(SessiontapeError):
    code = "engine_error"
