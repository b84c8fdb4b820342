from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class AuthLlmWorkerRequest(_message.Message):
    __slots__ = ("workerToken",)
    WORKERTOKEN_FIELD_NUMBER: _ClassVar[int]
    workerToken: str
    def __init__(self, workerToken: _Optional[str] = ...) -> None: ...

class AuthLlmWorkerResponse(_message.Message):
    __slots__ = ("routingKey",)
    ROUTINGKEY_FIELD_NUMBER: _ClassVar[int]
    routingKey: str
    def __init__(self, routingKey: _Optional[str] = ...) -> None: ...
