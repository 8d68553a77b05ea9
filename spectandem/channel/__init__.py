"""A direct verifier -> drafter channel for target features, so a round's features never cross
the router: a dedicated two-rank torch.distributed group between the two engines of
one node, the verifier rank 0 (sender), the drafter rank 1 (receiver).

    verifier: send([f_0, f_1]) -> [ChannelRef(7, 0), ChannelRef(7, 1)]     (returns at once)
                 | queue
                 v sender thread ---- header (gloo, CPU) ----------> receiver thread
                                 ---- payload (ring slot, NCCL, gloo) ---^     | mailbox {7: ...}
    router:   passes the ChannelRefs on, where the tensors went before           v
    drafter:  take(ChannelRef(7, 1)) -> f_1 (or FeatureChannelError: resync the request)

Glossary:
- message: one verifier call's features (a prefill's or a verify's; a call of more than
  MAX_ITEMS requests is split into several), a header and a payload, numbered by `seq` from 1.
- header: int64[HEADER_LEN] = [seq, num_items, ndim, dtype code, ring slot (-1: the payload
  follows over the group), shape of item 0, shape of item 1, ...], zero-padded. num_items = -1
  closes the channel. Two float32 items [3, 8] and [1, 8] as message 7 in slot 2:
  [7, 2, 2, 0, 2, 3, 8, 1, 8, 0, ...].
- payload transport, chosen when the channel comes up: both ends on one device (one GPU, or
  CPU engines on one host) -> a PayloadRing (ring.py): slots the verifier shared once (CUDA IPC,
  or host shared memory) that it writes and the drafter copies out of and releases; a message
  larger than a slot goes over the group (one finding every slot unread waits in the sender for
  a freed slot). Two GPUs -> NCCL.
  Otherwise (or when the drafter cannot map the ring) -> gloo.
- payload: uint8[nbytes], the items' bytes back to back, row-major. Above: 128 bytes, item 0 =
  payload[0:96].view(float32).view(3, 8), item 1 = payload[96:128].view(float32).view(1, 8).
- ChannelRef(seq, index): what the verifier returns in place of a tensor; opaque to the router.

Why headers go over gloo even between GPUs: a receiver that kept an NCCL recv posted while idle
would keep a kernel pending on the drafter's GPU, and any device-wide synchronize (CUDA graph
capture does one) would wait for the verifier's next message. So the receiver blocks on a CPU
socket and posts the NCCL recv of a payload only once its header says it is in flight.

Failure model: drafter failures never harm the verifier. `send` never blocks (a queue and a
thread); when the peer is gone, a send fails or is still not taken after `send_timeout_s` (seen
by the next `send` or `ready`), the sender logs once, aborts its group (ending any pending
kernel), drops what is queued and says `ready` False from then on: the verifier then returns
the tensors inline, as without a channel.
The receiver keeps at most `capacity` messages (and about `max_bytes`), dropping the oldest
with a log line; `take` of a dropped or late message raises FeatureChannelError, and the
drafter reports that request as unknown so the router resyncs it through the verifier's
ordinary Features call. A restarted drafter does not rejoin (the verifier's sender breaks).

Modules: wire.py (header, references, the two-rank group), ring.py (the payload ring),
sender.py, receiver.py; trees.py, the channel of the other direction: a round's draft trees,
drafter -> verifier, over a socket of their own (TreeHandOff: between two engines of one process).
"""

from spectandem.channel.receiver import FeatureReceiver
from spectandem.channel.sender import FeatureSender
from spectandem.channel.trees import TreeHandOff, TreeMailbox, TreePoster
from spectandem.channel.wire import (MAX_ITEMS, NCCL_ERROR_HANDLING, ChannelRef, FeatureChannelError,  # noqa: F401
                                     _Group, parse_address)   # (_Group: tests)

__all__ = ["MAX_ITEMS", "NCCL_ERROR_HANDLING", "ChannelRef", "FeatureChannelError", "FeatureReceiver", "FeatureSender",
           "TreeHandOff", "TreeMailbox", "TreePoster", "parse_address"]
