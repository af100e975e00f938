"""gRPC channel and server options both sides use: messages up to 2 GiB (columns travel as raw buffers).

Clients retry a lost daemon at most a second apart (gRPC's default backs off to 2 minutes), so
writers and samplers find a restarted daemon within about a second.
"""

MAX_MESSAGE_BYTES = (1 << 31) - 1
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
