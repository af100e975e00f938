"""gRPC channel and server options both sides use: messages up to 2 GiB (columns travel as raw buffers)."""

MAX_MESSAGE_BYTES = (1 << 31) - 1
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
