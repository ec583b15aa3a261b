from evergreen_trio._proto.evergreen.v2 import evergreen_pb2 as _evergreen_pb2
from google.protobuf import descriptor as _descriptor
from typing import ClassVar as _ClassVar

DESCRIPTOR: _descriptor.FileDescriptor
