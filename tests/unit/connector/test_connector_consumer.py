"""D's side-channel service over real loopback TCP, against a stand-in prefill that speaks the
wire protocol (no NIXL): connecting to one prefill never holds up the traffic with another."""
from __future__ import annotations

import contextlib
import select
import socket
import threading
import time

import pytest

from kvpush.connector import wire
from kvpush.connector.consumer import Consumer, ConsumerConfig
from kvpush.connector.regions import HeadLayout, LayoutIdentity, Region

pytestmark = pytest.mark.unit

IDENTITY = LayoutIdentity("m", "bfloat16", 16, ("l0",), 1)
REGIONS = (Region(1 << 20, 4096, 4096, 64),)
HEADS = (HeadLayout.whole(4096),)


class StandInPrefill:
    """Serves decode connections one after the other: WELCOME to a HELLO, PONG to PINGs; records
    when each REGISTER arrives, the CANCELs and how many connections it served."""

    def __init__(self, engine_id: str):
        self.engine_id = engine_id
        self.mute = False  # stop answering PINGs: a hung prefill
        self.admit_after_s: float | None = 0.0  # busy this long before its WELCOME (making a NIXL peer); None: never
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.registered: dict[str, float] = {}
        self.cancelled: list[str] = []
        self.connections = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):  # the listener closed
            while True:
                conn, _ = self.listener.accept()
                self.connections += 1
                self._serve_one(conn)

    def _serve_one(self, conn: socket.socket) -> None:
        self.conn = conn
        reader = wire.FrameReader()
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                for msg in map(wire.decode, reader.feed(data)):
                    if isinstance(msg, wire.Hello):
                        if self.admit_after_s is None:
                            self.mute = True
                            continue
                        time.sleep(self.admit_after_s)  # one thread: nothing else is answered meanwhile
                        conn.sendall(wire.encode(wire.Welcome(self.engine_id)))
                    elif isinstance(msg, wire.Ping) and not self.mute:
                        conn.sendall(wire.encode(wire.Pong()))
                    elif isinstance(msg, wire.Register):
                        self.registered[msg.transfer_id] = time.monotonic()
                    elif isinstance(msg, wire.Cancel):
                        self.cancelled.append(msg.transfer_id)

    def say(self, *msgs: wire.Message) -> None:
        self.conn.sendall(b"".join(wire.encode(m) for m in msgs))

    def hang_up(self) -> None:
        """Close the decode connection, as the kernel does for a prefill process that exited."""
        self.conn.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@contextlib.contextmanager
def unanswered_listener():
    """A loopback port whose accept queue is full: a further connect hangs until its timeout."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = []
    while len(queued) < 8:  # fill the queue: the first connect that times out found it full
        try:
            queued.append(socket.create_connection(listener.getsockname(), timeout=0.2))
        except TimeoutError:
            break
    try:
        yield listener.getsockname()[1]
    finally:
        for s in queued:
            s.close()
        listener.close()


def wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.005)
    return predicate()


def test_a_prefill_that_does_not_answer_the_connect_holds_up_no_other_prefill():
    good = StandInPrefill("P.good")
    stuck_connect_s = 3.0  # what a REGISTER queued behind the stuck connect would wait (under the 5 s transfer bound)
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P.good", "P.stuck"}), connect_timeout_s=stuck_connect_s),
                        "agent-D", b"meta", REGIONS)
    try:
        with unanswered_listener() as stuck_port:
            consumer.expect("r-stuck", "t-stuck", "P.stuck", "127.0.0.1", stuck_port, [1], 0, 16)
            time.sleep(0.05)  # the connect to P.stuck is under way
            asked = time.monotonic()
            consumer.expect("r-good", "t-good", "P.good", "127.0.0.1", good.port, [2], 0, 16)
            assert wait_for(lambda: good.registered.get("t-good"), 2 * stuck_connect_s)
            assert good.registered["t-good"] - asked < stuck_connect_s / 2  # a few thread hand-offs, not the stuck connect
            outcomes = wait_for(consumer.take_outcomes, 2 * stuck_connect_s)
        assert [(o.pending.transfer_id, o.ok) for o in outcomes] == [("t-stuck", False)]
        assert "cannot reach prefill P.stuck rank 0 side channel" in outcomes[0].reason
    finally:
        consumer.close()
        good.close()


def test_what_is_sent_while_connecting_follows_the_hello_in_order():
    good = StandInPrefill("P.good")
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P.good"})), "agent-D", b"meta", REGIONS)
    try:
        for i in range(3):
            consumer.expect(f"r{i}", f"t{i}", "P.good", "127.0.0.1", good.port, [i], 0, 16)
        assert wait_for(lambda: len(good.registered) == 3, 2.0)
        assert sorted(good.registered, key=good.registered.get) == ["t0", "t1", "t2"]
        assert consumer.take_counts() == {}
    finally:
        consumer.close()
        good.close()


def test_a_prefill_given_up_on_for_silence_may_still_write_one_that_hung_up_may_not():
    outcomes = {}
    for how in ("silent", "hung up"):
        p = StandInPrefill("P")
        # the stand-in answers PINGs from a thread of this process, which a loaded machine may hold up a while
        consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P"}), peer_silence_s=1.0),
                            "agent-D", b"meta", REGIONS)
        try:
            consumer.expect("r", "t", "P", "127.0.0.1", p.port, [1], 0, 16)
            assert wait_for(lambda: p.registered, 10.0)
            if how == "silent":
                p.mute = True
            else:
                p.hang_up()
            [outcomes[how]] = wait_for(consumer.take_outcomes, 10.0)
        finally:
            consumer.close()
            p.close()
    assert outcomes["silent"].may_still_land and "no answer" in outcomes["silent"].reason
    assert not outcomes["hung up"].may_still_land


def test_a_request_that_names_another_address_for_a_known_prefill_is_refused_without_dialing_it():
    """A client cannot point decode at a host of its choosing: the deployment says where P is."""
    good = StandInPrefill("P.good")
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P.good"}), peers={"P.good": ("127.0.0.1", good.port)}),
                        "agent-D", b"meta", REGIONS)
    try:
        with socket.create_server(("127.0.0.1", 0)) as elsewhere:
            elsewhere.settimeout(0.3)
            consumer.expect("r", "t-moved", "P.good", "127.0.0.1", elsewhere.getsockname()[1], [1], 0, 16)
            [outcome] = wait_for(consumer.take_outcomes, 2.0)
            assert not outcome.ok and "which the deployment places at 127.0.0.1:%d" % good.port in outcome.reason
            with pytest.raises(TimeoutError):
                elsewhere.accept()  # never dialed
        assert consumer.take_counts() == {"unknown_address": 1}
        consumer.expect("r2", "t-ok", "P.good", "127.0.0.1", good.port, [2], 0, 16)
        assert wait_for(lambda: good.registered.get("t-ok"), 2.0)
    finally:
        consumer.close()
        good.close()


def test_a_done_that_does_not_account_for_the_registered_bytes_fails_the_transfer():
    good = StandInPrefill("P.good")
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P.good"})), "agent-D", b"meta", REGIONS)
    try:
        consumer.expect("r", "t1", "P.good", "127.0.0.1", good.port, [1, 2], 0, 32)
        consumer.expect("r", "t2", "P.good", "127.0.0.1", good.port, [3], 0, 16)
        assert wait_for(lambda: len(good.registered) == 2, 2.0)
        good.conn.sendall(wire.encode(wire.Done("t1", 0)) + wire.encode(wire.Done("t2", 4096)))  # t1 claims nothing written
        got: list = []
        wait_for(lambda: got.extend(consumer.take_outcomes()) or len(got) == 2, 2.0)
        outcomes = {o.pending.transfer_id: o for o in got}
        assert not outcomes["t1"].ok and "reported 0 bytes written, but these blocks take 8192" in outcomes["t1"].reason
        assert outcomes["t2"].ok and outcomes["t2"].num_bytes == 4096
        assert consumer.take_counts()["bad_done"] == 1
    finally:
        consumer.close()
        good.close()


def test_a_prefill_slow_to_admit_is_not_taken_for_silent_and_one_that_never_admits_fails_at_the_bound():
    slow, never = StandInPrefill("P.slow"), StandInPrefill("P.never")
    slow.admit_after_s, never.admit_after_s = 2.0, None  # slower than the silence bound, and never
    # the silence bound leaves the stand-in's thread time to answer PINGs on a loaded machine; the
    # admission bound leaves the slow one time to admit
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P.slow", "P.never"}), peer_silence_s=1.0,
                                       admission_timeout_s=4.0), "agent-D", b"meta", REGIONS)
    try:
        consumer.expect("r-slow", "t-slow", "P.slow", "127.0.0.1", slow.port, [1], 0, 16)
        consumer.expect("r-never", "t-never", "P.never", "127.0.0.1", never.port, [2], 0, 16)
        assert wait_for(lambda: slow.registered.get("t-slow"), 10.0)  # admitted late, its REGISTER went through
        [outcome] = wait_for(consumer.take_outcomes, 10.0)
        assert outcome.pending.transfer_id == "t-never" and not outcome.ok
        assert "did not admit this decode rank within 4 s" in outcome.reason
        assert consumer.take_outcomes() == []  # the slow one is still pending, not failed for silence
    finally:
        consumer.close()
        slow.close()
        never.close()


def test_a_prefill_given_up_on_for_silence_keeps_its_connection_and_its_quiesced_ends_the_hold():
    """D fails the transfer of a silent P at once but, instead of hanging up, cancels it: a P that
    resumes answers on the same connection, and its QUIESCED (every WRITE it posted ended) is the
    evidence that frees the blocks. Its FAIL that a WRITE is still copying is not."""
    p = StandInPrefill("P")
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P"}), peer_silence_s=1.0, late_write_hold_s=600.0),
                        "agent-D", b"meta", REGIONS)
    try:
        consumer.expect("r", "t", "P", "127.0.0.1", p.port, [1], 0, 16)
        assert wait_for(lambda: p.registered, 10.0)
        p.mute = True
        [outcome] = wait_for(consumer.take_outcomes, 10.0)
        assert not outcome.ok and outcome.may_still_land and "no answer" in outcome.reason
        assert wait_for(lambda: p.cancelled == ["t"], 5.0) and p.connections == 1  # cancelled, not hung up on
        p.mute = False
        p.say(wire.Fail("t", "still copying", may_still_land=True))
        time.sleep(0.3)  # the consumer's reactor reads it
        assert consumer.take() == ([], [], [])
        p.say(wire.Quiesced("t"))
        assert wait_for(lambda: consumer.take()[2], 5.0) == ["t"]
    finally:
        consumer.close()
        p.close()


def test_the_backstop_drops_the_connection_counts_it_and_the_next_transfer_makes_a_new_one():
    p = StandInPrefill("P")
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P"}), peer_silence_s=1.0, late_write_hold_s=1.0),
                        "agent-D", b"meta", REGIONS)
    try:
        consumer.expect("r", "t1", "P", "127.0.0.1", p.port, [1], 0, 16)
        assert wait_for(lambda: p.registered, 10.0)
        p.mute = True  # hung for good: no QUIESCED will come
        prefill_end = p.conn.dup()  # prefill's socket as its posting thread sees it, whatever its reader does
        [outcome] = wait_for(consumer.take_outcomes, 10.0)
        assert outcome.may_still_land
        assert wait_for(lambda: consumer.take()[2], 10.0) == ["t1"]  # the backstop let the blocks go
        # ... only once prefill's kernel already saw the connection closed: a prefill resuming
        # right now finds the close in its check before a post, not a moment after
        poller = select.poll()
        poller.register(prefill_end, select.POLLRDHUP | select.POLLHUP)
        assert poller.poll(0)
        prefill_end.close()
        assert consumer.take_counts()["late_write_backstop"] == 1
        p.mute = False
        consumer.expect("r2", "t2", "P", "127.0.0.1", p.port, [2], 0, 16)
        assert wait_for(lambda: "t2" in p.registered, 10.0)
        assert p.connections == 2  # the dropped connection made anew, with a new handshake
    finally:
        consumer.close()
        p.close()


def test_a_transfer_that_ended_before_its_register_went_out_is_never_registered():
    """A REGISTER waits for its connection; the transfer may end meanwhile (here: no ACCEPTED in
    time while the connect hangs). When the connection comes, the REGISTER must not go out, or P
    would write into blocks vLLM may have given to another request; and the failure fences
    nothing, since P never learnt the blocks."""
    consumer = Consumer(ConsumerConfig("D", 0, IDENTITY, frozenset({"P"}), connect_timeout_s=10.0, timeout_s=0.2),
                        "agent-D", b"meta", REGIONS)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    queued = []
    try:
        while len(queued) < 8:  # fill the accept queue: decode's connect waits for a retried SYN
            try:
                queued.append(socket.create_connection(listener.getsockname(), timeout=0.2))
            except TimeoutError:
                break
        consumer.expect("r", "t", "P", "127.0.0.1", listener.getsockname()[1], [1], 0, 16)
        [outcome] = wait_for(consumer.take_outcomes, 5.0)
        assert not outcome.ok and not outcome.may_still_land and "did not accept" in outcome.reason
        listener.settimeout(10.0)
        for _ in queued:
            listener.accept()[0].close()  # room in the queue: decode's connect goes through now
        conn, _ = listener.accept()
        conn.settimeout(1.0)
        reader, got = wire.FrameReader(), []
        with contextlib.suppress(TimeoutError):
            while data := conn.recv(65536):
                got += [type(wire.decode(f)).__name__ for f in reader.feed(data)]
        assert got and "Hello" in got and "Register" not in got, got
        conn.close()
    finally:
        for q in queued:
            q.close()
        listener.close()
        consumer.close()
