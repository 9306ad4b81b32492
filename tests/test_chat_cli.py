"""`ikjax chat` as a process, stdin piped: two turns equal to Engine.chat with a kept session (the
second one fed from the cache), the first message from -f with a system prompt and another
template, Ctrl-C stopping an answer but not the chat, a bad template refused before loading."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest

import ikjax

ARGS = ["-c", "256", "-ub", "64", "--temp", "0"]


def _env():
    return {**os.environ, "PYTHONIOENCODING": "utf-8", "IKJAX_DEBUG": "1"}


def _chat(model, *args, stdin: bytes, timeout=240):
    res = subprocess.run([sys.executable, "-m", "ikjax.cli", "chat", "-m", model, *ARGS, *args], input=stdin,
                         capture_output=True, timeout=timeout, env=_env())
    return res.returncode, res.stdout.decode("utf-8"), res.stderr.decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def eng(tiny_model):
    return ikjax.load(tiny_model, ctx=256, ubatch=64)


def test_two_turns_stream_the_api_s_answers_from_the_cache(eng, tiny_model):
    rc, out, err = _chat(tiny_model, "-n", "8", "-cnv", "--jinja", stdin="Hello\nTell me\\\nmore\n".encode())
    assert rc == 0, err
    sess = eng.session()
    msgs = [{"role": "user", "content": "Hello"}]
    a1 = eng.chat(msgs, 8, session=sess).text
    msgs += [{"role": "assistant", "content": a1}, {"role": "user", "content": "Tell me\nmore"}]
    two = eng.chat(msgs, 8, session=sess)
    # prompts and answers on stdout, nothing else; the closing prompt met the end of input
    assert out == f"> {a1}\n> {two.text}\n> \n"
    assert "chat template: deepseek3" in err
    assert "chat: 2 turns; prompt tokens" in err and f"({two.usage.cached_tokens} reused from the KV cache" in err
    assert two.usage.cached_tokens > 0


def test_first_message_from_a_file_with_a_system_prompt(eng, tiny_model, tmp_path):
    f = tmp_path / "q.txt"
    f.write_text("Why is the sky blue? ☀", encoding="utf-8")
    rc, out, err = _chat(tiny_model, "-n", "6", "-f", str(f), "-sys", "Answer briefly.", "--chat-template", "chatml",
                         stdin=b"")
    assert rc == 0, err
    want = eng.chat([{"role": "system", "content": "Answer briefly."},
                     {"role": "user", "content": "Why is the sky blue? ☀"}], 6, chat_template="chatml").text
    assert out == f"> Why is the sky blue? ☀\n{want}\n> \n" and "chat template: chatml" in err


def test_bad_template_refused_before_loading(tiny_model, tmp_path):
    rc, out, err = _chat(tiny_model, "--chat-template", "nope", stdin=b"")
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: chat template 'nope'"), err


def test_a_message_that_cannot_be_sent_is_dropped_not_the_chat(eng, tiny_model):
    """A typed line with bytes that are not UTF-8 (a Latin-1 terminal's é) is dropped with a note
    and the chat goes on (it ended the program with status 1, the conversation lost)."""
    rc, out, err = _chat(tiny_model, "-n", "4", stdin=b"Hello\ncaf\xe9 au lait\nmore\n")
    assert rc == 0, err
    assert "[message dropped: message: not valid UTF-8 (byte 0xe9 at character 3); send it again]" in err
    assert "chat: 2 turns" in err and out.count("> ") == 4  # three lines read, then the end of input


def test_template_file_flag_always_reads_the_file(eng, tiny_model, tmp_path):
    """--chat-template-file NAME reads the file NAME even where NAME is also a builtin's name
    (it took the builtin chatml over ./chatml); the file flag and the name flag are one choice."""
    (tmp_path / "chatml").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] ")
    res = subprocess.run([sys.executable, "-m", "ikjax.cli", "chat", "-m", tiny_model, *ARGS, "-n", "3",
                          "--chat-template-file", "chatml", "-v"], input=b"Hi\n", capture_output=True, timeout=240,
                         env=_env(), cwd=tmp_path)
    err = res.stderr.decode()
    assert res.returncode == 0, err
    assert f"chat template: {tmp_path / 'chatml'}" in err
    want = eng.chat([{"role": "user", "content": "Hi"}], 3, chat_template=str(tmp_path / "chatml"))
    assert f"prompt {want.usage.prompt_tokens} tokens" in err
    rc, _, err = _chat(tiny_model, "--chat-template", "chatml", "--chat-template-file", "x", stdin=b"")
    assert rc == 1 and err.strip().splitlines()[-1] == "error: --chat-template and --chat-template-file: give one of them"


def test_ctrl_c_stops_the_answer_not_the_chat(tiny_model):
    p = subprocess.Popen([sys.executable, "-m", "ikjax.cli", "chat", "-m", tiny_model, *ARGS, "--ignore-eos", "-v"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
    try:
        p.stdin.write(b"Hi\n")
        p.stdin.flush()
        got = b""
        deadline = time.time() + 180
        while len(got) < 8 and time.time() < deadline:  # "> " and a few tokens of the answer
            if select.select([p.stdout], [], [], 1)[0]:
                got += os.read(p.stdout.fileno(), 4096)
        assert len(got) >= 8, got
        p.send_signal(signal.SIGINT)
        while b"\n> " not in got and time.time() < deadline:  # back at the prompt
            if select.select([p.stdout], [], [], 1)[0]:
                got += os.read(p.stdout.fileno(), 4096)
        assert b"\n> " in got
        p.stdin.close()  # end of input ends the chat
        rc = p.wait(60)
        err = p.stderr.read().decode()
    finally:
        if p.poll() is None:
            p.kill()
    assert rc == 0, err
    assert "[answer stopped]" in err and "chat: 1 turns" in err
    # the answer was cut short of the context's end (256 tokens less the prompt)
    turn = next(line for line in err.splitlines() if line.startswith("turn 1: "))
    n_prompt, n_answer = int(turn.split("prompt ")[1].split()[0]), int(turn.split("answer ")[1].split()[0])
    assert 0 < n_answer < 256 - n_prompt, turn


def test_fit_drops_the_oldest_exchanges_and_keeps_the_system_prompt(eng):
    """Chat.fit: the oldest exchanges go (the system prompt stays) until the conversation leaves room
    for an answer (min(-n or a quarter of -c, half of -c)); a message too long on its own drops
    nothing (the turn is dropped instead)."""
    from ikjax.cli.chat import Chat
    from ikjax.runtime.text import encode_prompt, render_chat
    c = Chat(eng, eng.chat_template(), {}, 32, "Be brief.", False)
    for i in range(12):
        c.messages += [{"role": "user", "content": f"question {i} " * 4}, {"role": "assistant", "content": f"answer {i} " * 6}]
    c.messages.append({"role": "user", "content": "last"})
    dropped = c.fit()
    n = len(encode_prompt(eng, render_chat(eng, c.messages, c.template)))
    assert dropped > 0 and n <= 256 - 32 and c.messages[0] == {"role": "system", "content": "Be brief."}
    assert c.messages[1]["role"] == "user" and c.messages[-1] == {"role": "user", "content": "last"}
    assert c.messages[1]["content"].startswith(f"question {dropped} ")  # the oldest went first, whole exchanges
    before = list(c.messages)
    c.messages.append({"role": "user", "content": "word " * 400})
    assert c.fit() == 0 and c.messages[:-1] == before


def test_terminal_lines_past_4095_bytes_editing_keys_and_ctrl_c(eng, tiny_model):
    """On a terminal (a pty here) a typed line is read whole past the kernel's 4095-byte canonical
    line, also one typed while the model still loads (the terminal is raw from the start, as
    llama-cli's); backspace and an arrow key (its bytes in two reads) edit it as a terminal would;
    Ctrl-C at the prompt (the terminal's ^C, a SIGINT from the line discipline) still ends the chat
    with 130, and the terminal's own settings are back."""
    import pty
    import re
    import termios

    from ikjax.runtime.text import encode_prompt, render_chat

    master, slave = pty.openpty()
    own_settings = termios.tcgetattr(slave)

    # the pty made the chat's controlling terminal in a session of its own (no preexec_fn: this
    # process runs JAX's threads), so its ^C is a SIGINT to the chat alone
    # SIGINT back to its default first: a suite started as a background job of a script (`pytest &`)
    # runs with SIGINT ignored, which its children inherit, and the chat then never saw its Ctrl-C
    own_terminal = ("import fcntl, os, signal, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
                    "signal.signal(signal.SIGINT, signal.SIG_DFL); "
                    "os.execv(sys.executable, [sys.executable, '-m', 'ikjax.cli'] + sys.argv[1:])")
    p = subprocess.Popen([sys.executable, "-c", own_terminal, "chat", "-m", tiny_model, *ARGS, "-n", "2", "-v"],
                         stdin=slave, stdout=slave, stderr=subprocess.PIPE, env=_env(), start_new_session=True)
    err = b""

    def read_err_until(marker: bytes, deadline: float) -> bytes:
        nonlocal err
        while marker not in err and time.time() < deadline:
            if select.select([p.stderr], [], [], 0.2)[0]:
                chunk = os.read(p.stderr.fileno(), 65536)
                if not chunk:
                    break
                err += chunk
            while select.select([master], [], [], 0)[0]:  # keep the terminal's output drained
                os.read(master, 65536)
        return err

    def wait_raw(deadline: float) -> None:
        """Until the chat reads its line with the terminal out of canonical mode."""
        while time.time() < deadline:
            if not termios.tcgetattr(slave)[3] & termios.ICANON:
                return
            read_err_until(b"\0never", time.time() + 0.05)
        raise AssertionError(f"the chat never read the terminal raw; stderr: {err.decode(errors='replace')}")

    def wait_reading(deadline: float) -> None:
        """Until the chat's main thread is blocked waiting for the terminal (a select or read of fd 0
        in /proc/PID/syscall): the terminal is raw from the start, so its mode no longer says when the
        chat waits at its prompt, and a Ctrl-C sent while the last turn was still ending could land
        in a callback that swallows it."""
        while time.time() < deadline:
            try:
                with open(f"/proc/{p.pid}/syscall") as f:
                    # blocked on the terminal (fd 0): in a select of it (x86-64's select 23, pselect6
                    # 270: one fd; the reader waits in short selects) or in its read
                    if f.read().startswith(("0 0x0 ", "23 0x1 ", "270 0x1 ")):
                        return
            except OSError:
                pass
            read_err_until(b"\0never", time.time() + 0.05)
        raise AssertionError(f"the chat never waited at its prompt; stderr: {err.decode(errors='replace')}")

    try:
        deadline = time.time() + 240
        long_line = "word " * 1300  # 6500 bytes: a canonical terminal keeps 4095 of them
        wait_raw(deadline)
        data = long_line.encode() + b"\r"
        while data:
            data = data[os.write(master, data[:1024]):]
            read_err_until(b"\0never", time.time() + 0.01)
        read_err_until(b"more than -c", deadline)
        whole = len(encode_prompt(eng, render_chat(eng, [{"role": "user", "content": long_line}])))
        assert f"the conversation with it is {whole} tokens".encode() in err, err.decode(errors="replace")
        wait_reading(deadline)
        os.write(master, b"Hx\x7fi\x1b")  # backspace over the x, an up arrow dropped (its bytes in two reads)
        time.sleep(0.1)
        os.write(master, b"[A\r")
        while not re.search(rb"turn 1: [^\n]*\n", err) and time.time() < deadline:
            read_err_until(b"\0never", time.time() + 0.2)
        turn = next(line for line in err.decode().splitlines() if line.startswith("turn 1: "))
        hi = len(encode_prompt(eng, render_chat(eng, [{"role": "user", "content": "Hi"}])))
        assert turn.startswith(f"turn 1: prompt {hi} tokens"), (turn, hi)
        wait_reading(deadline)
        os.write(master, b"\x03")  # Ctrl-C at the prompt
        rc = p.wait(60)
        assert termios.tcgetattr(slave) == own_settings  # the terminal's own settings back
    finally:
        if p.poll() is None:
            p.kill()
        os.close(master)
        os.close(slave)
    assert rc == 130, err.decode(errors="replace")


def test_reverse_prompt_is_shown_as_llama_cli_shows_it(eng, tiny_model):
    """-r: the answer stops at the string and the string is printed with it (llama-cli prints the
    reverse prompt as generated text; the chat hid it)."""
    msgs = [{"role": "user", "content": "Hi"}]
    want = eng.chat(msgs, 24, ignore_eos=True).text
    stop = next(want[i:i + 3] for i in range(len(want) // 3, len(want) - 3)
                if want[i:i + 3].strip() and want[i:i + 3] not in want[:i])
    rc, out, err = _chat(tiny_model, "-n", "24", "--ignore-eos", "-r", stop, "--no-escape", stdin=b"Hi\n")
    assert rc == 0, err
    assert "> " + want[:want.index(stop) + len(stop)] + "\n" in out, (out, stop)
