"""A headless notebook run reads each cell's reply in short polls
(course_lib.runtime.kernel_replies): a reply whose wake-up was lost is read at the end of a
quarter-second poll, not of the cell's whole timeout."""

import asyncio
from queue import Empty

import pytest
from jupyter_client.channels import AsyncZMQSocketChannel

from course_lib.runtime import kernel_replies


class LostWakeUp:
    """A shell socket whose reply is already there but whose poll, like one that missed the
    socket's edge, only finds it when the poll's own timeout ends."""

    def __init__(self, replies=1):
        self.replies, self.polls = replies, []

    async def poll(self, timeout_ms):
        self.polls.append(timeout_ms)
        await asyncio.sleep(timeout_ms / 1000)
        return int(self.replies > 0)


class Channel:
    def __init__(self, socket):
        self.socket = socket

    async def _recv(self):
        self.socket.replies -= 1
        return {"msg_type": "execute_reply"}


def test_a_reply_whose_wake_up_was_lost_is_read_after_one_short_poll():
    socket = LostWakeUp()
    reply = asyncio.run(kernel_replies.get_msg_in_slices(Channel(socket), timeout=600))
    assert reply == {"msg_type": "execute_reply"}
    # jupyter_client's own get_msg polls once for the whole 600 s: [600000]
    assert socket.polls == [kernel_replies.SLICE_S * 1000]


def test_the_timeout_is_kept_and_ends_in_empty():
    socket = LostWakeUp(replies=0)
    with pytest.raises(Empty):
        asyncio.run(kernel_replies.get_msg_in_slices(Channel(socket), timeout=0.6))
    assert len(socket.polls) >= 2 and max(socket.polls) <= kernel_replies.SLICE_S * 1000
    assert sum(socket.polls) >= 590  # the whole timeout was waited, in slices


def test_a_real_kernel_answers_through_the_sliced_channels():
    from jupyter_client.manager import start_new_async_kernel

    async def run():
        km, kc = await start_new_async_kernel(startup_timeout=120)
        try:
            msg_id = kc.execute("6 * 7")
            while True:
                reply = await kc.shell_channel.get_msg(timeout=60)
                if reply["parent_header"].get("msg_id") == msg_id:
                    return reply
        finally:
            kc.stop_channels()
            await km.shutdown_kernel(now=True)

    original = AsyncZMQSocketChannel.get_msg
    kernel_replies.poll_in_slices()
    try:
        assert AsyncZMQSocketChannel.get_msg is kernel_replies.get_msg_in_slices
        assert asyncio.run(run())["content"]["status"] == "ok"
    finally:
        AsyncZMQSocketChannel.get_msg = original
