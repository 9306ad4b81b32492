"""A typed line from a terminal, of any length, for `ikjax chat`.

Why not `readline()` on the terminal: in the kernel's canonical mode a line holds at most 4095
bytes, and the rest of a long pasted prompt was cut without a word (llama-cli reads its terminal
raw for the same reason). GNU readline reads past that, but takes Ctrl-C over, and a Ctrl-C at the
prompt no longer ended the chat. So the line is read here with the terminal out of canonical mode
for that one line: its signals stay on (Ctrl-C is still SIGINT, raised as KeyboardInterrupt in
`os.read`), the echo and the few editing keys a line discipline offers are done by hand
(backspace, Ctrl-U, Ctrl-W, Ctrl-D), escape sequences (arrows) are skipped, and the terminal's
settings are put back before the line is returned, whatever ends the read.

`raw_session` keeps the terminal out of canonical mode for a whole chat, as llama-cli does from its
start: a long line typed or pasted while the model loads or an answer streams would otherwise meet
the same 4095-byte line there and be cut. After Ctrl-Z and `fg` (SIGCONT) the settings are applied
again (the shell put its own back), and the terminal's own are restored when the chat ends, however.
"""
from __future__ import annotations

import contextlib
import os
import select
import signal
import termios

from ikjax import interrupt

_ERASE = (0x7F, 0x08)
_KILL, _WERASE, _EOF, _ESC = 0x15, 0x17, 0x04, 0x1B


class TtyLines:
    """Lines read from the terminal `fd` (bytes kept after a line, as a paste of several lines
    leaves, are the next lines)."""

    def __init__(self, fd: int, echo_fd: int | None):
        self.fd, self.echo_fd = fd, echo_fd
        self.pending = b""

    def _echo(self, data: bytes) -> None:
        if self.echo_fd is not None and data:
            try:
                os.write(self.echo_fd, data)
            except OSError:
                self.echo_fd = None

    def _next(self) -> int | None:
        """The next input byte (None at the end of input)."""
        if not self.pending:
            # waited for in short selects, not in one blocking read: a SIGINT the kernel hands to
            # another of the process's threads (JAX's) does not interrupt the main thread's read, and
            # Python runs its handler (KeyboardInterrupt) only when the main thread next runs Python
            # code; a Ctrl-C swallowed where it landed is raised here too (interrupt.check)
            while not select.select([self.fd], [], [], 0.2)[0]:
                interrupt.check()
            self.pending = os.read(self.fd, 65536)
            if not self.pending:
                return None
        b, self.pending = self.pending[0], self.pending[1:]
        return b

    def readline(self) -> bytes:
        """One line, its newline kept (b"" at the end of input, as a file's readline)."""
        if self.fd in _sessions:  # already raw for the whole chat
            return self._line()
        old = termios.tcgetattr(self.fd)
        _set_raw(self.fd)
        try:
            return self._line()
        finally:
            termios.tcsetattr(self.fd, termios.TCSANOW, old)

    def _line(self) -> bytes:
        buf = bytearray()
        while True:
            b = self._next()
            if b is None:
                return bytes(buf)
            if b in (0x0A, 0x0D):  # Enter (ICRNL maps CR to NL; a bare CR counts too)
                self._echo(b"\r\n")
                return bytes(buf) + b"\n"
            if b in _ERASE:
                self._erase_chars(buf, 1)
            elif b == _KILL:
                self._erase_chars(buf, len(buf))
            elif b == _WERASE:
                text = buf.decode("utf-8", errors="replace")
                i = len(text)
                while i and text[i - 1] in " \t":  # the blanks after the word, then the word
                    i -= 1
                while i and text[i - 1] not in " \t":
                    i -= 1
                self._erase_chars(buf, len(text) - i)
            elif b == _EOF:
                if not buf:
                    return b""
                return bytes(buf)  # (a canonical terminal's Ctrl-D: the line so far, no newline)
            elif b == _ESC:
                self._skip_escape()
            elif b < 0x20 and b != 0x09:
                continue  # other control keys: nothing, as no character of the line
            else:
                buf.append(b)
                self._echo(bytes([b]))

    def _erase_chars(self, buf: bytearray, n: int) -> None:
        """Take the last `n` characters (UTF-8 sequences, not bytes) off `buf` and the screen."""
        for _ in range(n):
            if not buf:
                return
            while len(buf) > 1 and 0x80 <= buf[-1] < 0xC0:  # continuation bytes, then the lead byte
                buf.pop()
            buf.pop()
            self._echo(b"\b \b")

    def _skip_escape(self) -> None:
        """An escape sequence (an arrow key: ESC [ A) read and dropped: CSI / SS3 up to the final byte.
        Its bytes may come in separate reads (a slow link): the next is waited for a moment; a lone
        Esc drops nothing after it."""
        if not self.pending and not select.select([self.fd], [], [], 0.5)[0]:
            return  # a lone Esc
        b = self._next()
        if b not in (0x5B, 0x4F):  # '[' or 'O': not a sequence, the key after the Esc stays
            self.pending = bytes([b]) + self.pending if b is not None else self.pending
            return
        while (c := self._next()) is not None and not 0x40 <= c <= 0x7E:
            pass


_reader: TtyLines | None = None
_sessions: dict[int, list] = {}  # terminals kept raw by raw_session -> their own settings


def _set_raw(fd: int) -> None:
    raw = termios.tcgetattr(fd)
    raw[3] &= ~(termios.ICANON | termios.ECHO)  # (ISIG kept: Ctrl-C is SIGINT, Ctrl-Z SIGTSTP)
    raw[6][termios.VMIN], raw[6][termios.VTIME] = 1, 0
    termios.tcsetattr(fd, termios.TCSANOW, raw)  # (TCSANOW: input typed ahead is kept)


@contextlib.contextmanager
def raw_session(fd: int | None):
    """The terminal `fd` out of canonical mode until the block ends (None, or not a terminal:
    nothing done); its settings restored at the end, and applied again after SIGCONT."""
    if fd is None or not os.isatty(fd) or fd in _sessions:
        yield
        return
    old = termios.tcgetattr(fd)
    _set_raw(fd)
    _sessions[fd] = old

    def again(signum, frame):
        if fd in _sessions:
            with contextlib.suppress(termios.error, OSError):
                _set_raw(fd)
    previous = signal.signal(signal.SIGCONT, again)
    try:
        yield
    finally:
        _sessions.pop(fd, None)
        with contextlib.suppress(termios.error, OSError):
            termios.tcsetattr(fd, termios.TCSANOW, old)
        signal.signal(signal.SIGCONT, previous)


def read_line(fd: int, out_fd: int | None) -> bytes:
    """A line from the terminal `fd`, echoed to `out_fd` (a terminal), kept across calls."""
    global _reader
    if _reader is None or _reader.fd != fd:
        _reader = TtyLines(fd, out_fd)
    return _reader.readline()
