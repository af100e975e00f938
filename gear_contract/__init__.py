"""The contract both sides speak: generated protos, hand-framed wire pieces, segment layout,
nest structure and specs, table options, data-plane negotiation and addressing, the verbs wrapper.

Client, server and kernels import this package; it imports none of them, starts no
threads and serves no RPCs.
"""
