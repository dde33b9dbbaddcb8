"""A warm interpreter for the suite's subprocesses: `python script.py ...` costs ~3 s of imports
(torch, transformers) before the script's first line, and the suite starts a hundred or more of
them (its two-step runs, the exercises as printed, the pipeline's stages, the grader). conftest.py
starts `serve` once per worker, after torch and transformers are imported and before any of them
runs an op, and points `sys.executable` (and so every `[sys.executable, ...]`, `$PYTHON` and the
exercises' `$PY`) at a shim that runs this file as the client.

The client (stdlib only, started with -S: ~20 ms) hands the server its argv, working dir,
environment and its stdin/stdout/stderr; the server forks, and the child runs the script as
`python script.py` would (`__main__`, sys.argv, sys.path[0] its folder, the repo's modules imported
afresh from there: a handout's copy imports its own), while the client waits, forwards a signal
(`timeout 40`, a test's kill) to the child, and exits with the child's status. Whatever is not a
plain `python FILE.py ...` (-m, -c, options), or an environment that differs from the server's in
what is read at import (IMPORT_TIME: the CPU's capability, threads, a C++ compiler, the hub's
offline switch), runs in a real interpreter, as before."""
import json
import os
import signal
import socket
import struct
import sys

# what the interpreter, torch (its CPU dispatch, thread pools, inductor's config: CXX) or transformers
# (HF_HUB_OFFLINE) read once, at start or import: a request that sets any of them otherwise than the
# server's environment runs in a real interpreter
IMPORT_TIME = ("ATEN_", "ONEDNN_", "MKL_", "OMP_", "KMP_", "TORCH", "PYTORCH_", "CUDA", "HF_", "TRANSFORMERS_",
               "LD_")
IMPORT_TIME_KEYS = ("CXX", "CC", "PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME", "PYTHONWARNINGS")


def import_time(env):
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) or k in IMPORT_TIME_KEYS}


def _send(sock, obj):
    data = json.dumps(obj).encode()
    sock.sendall(struct.pack("!I", len(data)) + data)


def _recv(sock):
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        if not chunk:
            return None
        head += chunk
    n, data = struct.unpack("!I", head)[0], b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:  # the other side died mid-message
            return None
        data += chunk
    return json.loads(data)


def die_with(parent):
    """End this process when `parent` (a pid) ends, however it ends (a kill, os._exit, a grader's
    limit): Linux's parent-death signal, then a check that the parent had not gone before it was set.
    Without it a pytest run that ended without its teardown left its server behind (parent 1, ~345 MB)."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def serve(path, parent):
    """Listen on the UNIX socket `path`; fork a child for each request (never returns); die with the
    process `parent`."""
    die_with(parent)
    import torch  # noqa: F401  the imports the children inherit: nothing runs yet
    import transformers  # noqa: F401
    from transformers.models.qwen2 import modeling_qwen2  # noqa: F401
    base_env = import_time(os.environ)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # no zombies; the client reports the status
    while True:
        conn, _ = server.accept()
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        n = struct.unpack("!I", msg[:4])[0]
        while len(msg) < 4 + n:
            msg += conn.recv(4 + n - len(msg))
        req = json.loads(msg[4:4 + n])
        if import_time(req["env"]) != base_env:
            _send(conn, {"pid": 0})  # the client runs a real interpreter
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            server.close()
            _child(conn, req, fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _child(conn, req, fds):
    """Run the script as `python script args` would, report its exit status, and exit."""
    import runpy
    import threading
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)

    def watch():  # the client gone (killed: a timeout, a grader's limit) takes this run with it
        try:
            while conn.recv(1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Thread(target=watch, daemon=True).start()
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    sys.stdin = open(0, closefd=False)
    line = os.isatty(1) or bool(req["env"].get("PYTHONUNBUFFERED")) or req.get("unbuffered")
    sys.stdout = open(1, "w", closefd=False, buffering=1 if line else -1)
    sys.stderr = open(2, "w", closefd=False, buffering=1)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    script = req["argv"][0]
    sys.argv = list(req["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    _send(conn, {"pid": os.getpid()})
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        try:
            _send(conn, {"code": code})
        finally:
            os._exit(code)


def client(real, path, args):
    """Be `python args...`: through the server when args is a plain script run, else exec `real`."""
    unbuffered = args[:1] == ["-u"]
    script = args[1:] if unbuffered else args
    if not script or not script[0].endswith(".py") or not os.path.isfile(script[0]):
        os.execv(real, [real, *args])
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        os.execv(real, [real, *args])
    data = json.dumps({"argv": script, "cwd": os.getcwd(), "env": dict(os.environ),
                       "unbuffered": unbuffered}).encode()
    socket.send_fds(sock, [struct.pack("!I", len(data)) + data], [0, 1, 2])
    pid = (_recv(sock) or {}).get("pid", 0)
    if not pid:
        os.execv(real, [real, *args])
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda s, _: os.kill(pid, s))
    reply = _recv(sock)
    if reply is None:  # the child died without a word: killed by a signal
        sys.exit(1)
    sys.exit(reply["code"])


if __name__ == "__main__":
    if sys.argv[1] == "--serve":  # --serve SOCKET PARENT_PID
        serve(sys.argv[2], int(sys.argv[3]))
    if not os.environ.get("WARM_PYTHON"):  # an environment of its own: a real interpreter
        os.execv(sys.argv[1], sys.argv[1:])
    client(sys.argv[1], os.environ["WARM_PYTHON"], sys.argv[2:])
