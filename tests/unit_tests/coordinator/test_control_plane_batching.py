"""What leaves as one ZMQ message on the control plane, and that every part of one is read: a
client's first message of an event-loop turn leaves at once and the rest of the turn's as one
message when the turn ends; the coordinator's answers to one peer in one turn leave as one
message; the coordinator and a peer read each part of a several-message message, in order."""
from __future__ import annotations

import asyncio

from megatron_async.client.channel import ClientChannel
from megatron_async.coordinator import messages
from megatron_async.coordinator.transport import PeerSocket
from megatron_async.coordinator.trust import peer_secret


class Sock:
    closed = False


class RecordingPeer:
    """A PeerSocket's sending side: each ZMQ message sent, as its list of frames."""

    def __init__(self):
        self.lost, self.sock, self.welcome, self.sent = False, Sock(), {}, []

    def send_frames(self, frames: list[bytes]) -> None:
        self.sent.append(list(frames))

    def readable(self) -> bool:
        return False


def test_a_turns_first_message_leaves_at_once_and_the_rest_of_the_turn_as_one():
    peer = RecordingPeer()
    channel = ClientChannel(peer, client=type("Client", (), {})())

    async def main():
        channel.loop = asyncio.get_running_loop()
        for rid in (1, 2, 3):
            channel.send("abort", rid)
        assert peer.sent == [[messages.encode("abort", 1)]]  # at once: no turn of the loop waited for
        await asyncio.sleep(0)  # the turn ends
        assert peer.sent[1:] == [[messages.encode("abort", 2), messages.encode("abort", 3)]]
        channel.send("abort", 4)  # a later turn's first message: at once again
        assert peer.sent[2:] == [[messages.encode("abort", 4)]]
        await asyncio.sleep(0)
        assert len(peer.sent) == 3

    asyncio.run(main())


def test_several_messages_in_one_are_each_read_and_answered_as_one(server):
    client = PeerSocket(server.address, peer_secret(server.address), "client", "me", 5)
    try:
        client.send_frames([messages.encode("engines", op) for op in (7, 8, 9)])  # one ZMQ message
        assert client.sock.poll(5000)
        answer = client.sock.recv_multipart()  # the turn's three answers: one ZMQ message
        assert [messages.decode(part)[1][0] for part in answer] == [7, 8, 9]
        client.send_frames([messages.encode("engines", op) for op in (10, 11)])
        assert client.sock.poll(5000)
        got = client.take()  # everything waiting (a client reads on the descriptor's edge), each part a message
        assert [(kind, fields[0], fields[1]) for kind, fields in got] == [("control_done", 10, 200),
                                                                          ("control_done", 11, 200)]
        assert client.stats.frames == 2 and not client.stats.dropped and not client.lost
    finally:
        client.close()
    assert server.listener.stats.frames >= 5 and not server.listener.stats.dropped

