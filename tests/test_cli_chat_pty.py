"""`folio chat` in a pseudo-terminal, as a person types to it: Ctrl-C is the
byte \\x03 that the terminal turns into SIGINT for the foreground process."""

import codecs
import os
import pty
import select
import signal
import sys
import time

import pytest

from tests.utils import make_tiny_model

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="needs a POSIX pty")


class Terminal:
    """A child process on a pty: send keys, wait for text (\\r dropped from the output)."""

    def __init__(self, argv: list[str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:      # the child: stdin, stdout and stderr are the pty
            # A background job inherits SIGINT ignored, and exec keeps it so;
            # a person's terminal does not.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            try:
                os.execv(sys.executable, [sys.executable, *argv])
            finally:
                os._exit(127)      # never run the rest of pytest in the child
        self.seen, self.pos, self.status = "", 0, None
        # A character may arrive split across two reads.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def send(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def _read(self, timeout: float) -> bool:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        try:
            data = os.read(self.fd, 65536)
        except OSError:        # the child exited and closed the pty
            return False
        self.seen += self._decoder.decode(data).replace("\r", "")
        return bool(data)

    def expect(self, text: str, timeout: float = 60) -> str:
        """Wait for `text` after what was matched before; the output up to it."""
        end = time.monotonic() + timeout
        while (at := self.seen.find(text, self.pos)) < 0:
            left = end - time.monotonic()
            got_more = left > 0 and self._read(min(1.0, left))
            if left <= 0 or not got_more and self.exited():
                raise AssertionError(f"no {text!r} within {timeout}s; output:\n{self.seen}")
        before, self.pos = self.seen[self.pos:at], at + len(text)
        return before

    def wait_for_more(self, chars: int, timeout: float = 60) -> None:
        end = time.monotonic() + timeout
        while len(self.seen) - self.pos < chars:
            assert time.monotonic() < end, f"output stalled:\n{self.seen}"
            self._read(0.5)

    def exited(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status is not None

    def wait(self, timeout: float = 30) -> int:
        end = time.monotonic() + timeout
        while not self.exited():
            assert time.monotonic() < end, f"still running:\n{self.seen}"
            self._read(0.2)
        return self.status

    def close(self) -> None:
        if not self.exited():
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # Wider than make_tiny_model's default so that a 300-token reply lasts
    # over a second (~4 ms a token on an idle machine): Ctrl-C surely lands
    # inside it. The generous timeouts are for a loaded machine only.
    return make_tiny_model(tmp_path_factory.mktemp("pty"), hidden_size=512,
                           intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
                           num_key_value_heads=4, max_position_embeddings=2048)


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(model):
    term = Terminal(["-m", "folio.cli", "chat", "--model", model, "--dtype", "float32",
                     "--num-kv-blocks", "160", "--ignore-eos", "--max-tokens", "300"])
    try:
        term.expect("Ctrl-D quits.", timeout=180)       # the banner: the model is loaded
        term.expect("> ")
        term.send("/bogus\n")                           # a mistyped command: never sent
        term.expect("/bogus\n")
        assert term.expect("> ").startswith("unknown command /bogus; commands: /history, ")

        term.send("first message\n")
        term.expect("first message\n")                  # the terminal's echo
        term.wait_for_more(40)                          # the reply is streaming
        term.send("\x03")
        partial = term.expect("[reply stopped]\n")
        term.expect("> ")

        term.send("\x03")                               # at the prompt: nothing is lost
        term.expect("(Ctrl-C stops a reply; /exit or Ctrl-D quits)\n")
        term.expect("> ")

        term.send("second message\n")
        term.expect("second message\n")
        term.expect("[reply cut at --max-tokens 300]\n", timeout=240)
        term.expect("> ")

        term.send("/history\n")
        history = term.expect("> ")
        assert history.count("[user] ") == 2 and history.count("[assistant] ") == 2
        assert "[user] first message\n" in history and "[user] second message\n" in history
        assert f"[assistant] {partial.strip()[:20]}" in history   # the stopped reply is kept

        term.send("\x04")                               # Ctrl-D quits
        assert term.wait() == 0
    finally:
        term.close()
