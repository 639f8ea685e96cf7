"""No host conversion of a tensor that may live on a GPU without an explicit move to the
CPU (issue 48 item 5): ``t.numpy()`` raises on a CUDA tensor ("can't convert cuda:0 device
type tensor to numpy"), and so does ``np.asarray(t)`` / ``np.array(t)`` (through
``Tensor.__array__``), so in ``tpkit/`` each must be reached from an explicit move:
``.cpu()``, ``.to("cpu")``, ``.to(device="cpu", ...)``, ``torch.device("cpu")``, in the
same expression or in the assignment of the name it starts from (in the same function).
The HF export's ``.numpy()`` on the gathered weights (a CUDA tensor on a GPU) was the
defect (tpkit/models/hf.py).

Python lists and scalars (``.tolist()``, ``.item()``, ``int(t)``) are not flagged: PyTorch
defines them on every device (a device-to-host copy and a sync). numpy arrays built from
Python lists, files or memory maps (tpkit.data) are not tensors and are not flagged.
Planted: the check flags the snippets of test_check_flags_device_conversions, and
tpkit/models/hf.py without its ``device="cpu"``.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NP_BUILDERS = {"array", "asarray", "asanyarray", "ascontiguousarray"}
# methods that return a tensor: a numpy builder applied to such a call gets a tensor
TENSOR_METHODS = {"detach", "float", "double", "half", "bfloat16", "long", "int", "to",
                  "contiguous", "flatten", "reshape", "view", "clone", "numel", "squeeze",
                  "unsqueeze", "permute", "transpose", "t", "sum", "mean", "cumsum"}


def _moves_to_cpu(node) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute):
            if n.func.attr == "cpu":
                return True
            if n.func.attr == "to":
                vals = list(n.args) + [k.value for k in n.keywords if k.arg == "device"]
                if any(isinstance(v, ast.Constant) and v.value == "cpu" for v in vals):
                    return True
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and \
                n.func.attr == "device" and any(isinstance(a, ast.Constant) and a.value == "cpu"
                                                for a in n.args):
            return True
    return False


def _root(node):
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _tensor_like(node) -> bool:
    return any(isinstance(n, ast.Call) and (
        isinstance(n.func, ast.Attribute) and (n.func.attr in TENSOR_METHODS or (
            isinstance(n.func.value, ast.Name) and n.func.value.id == "torch")))
        for n in ast.walk(node))


def check_source(src: str, path: str = "<src>") -> list[str]:
    """``path:line: what`` for each host conversion not reached from a move to the CPU."""
    tree = ast.parse(src, path)
    bad = []
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in funcs + [tree]:
        moved = set()   # names assigned from an expression that moves to the CPU
        for n in ast.walk(scope):
            if isinstance(n, ast.Assign) and _moves_to_cpu(n.value):
                moved.update(t.id for t in n.targets if isinstance(t, ast.Name))
        for n in ast.walk(scope):
            if not isinstance(n, ast.Call) or not isinstance(n.func, ast.Attribute):
                continue
            if n.func.attr == "numpy" and not n.args:
                recv = n.func.value
                if not (_moves_to_cpu(recv) or _root(recv) in moved):
                    bad.append(f"{path}:{n.lineno}: .numpy() without a move to the CPU")
            elif n.func.attr in NP_BUILDERS and isinstance(n.func.value, ast.Name) and \
                    n.func.value.id in ("np", "numpy") and n.args:
                arg = n.args[0]
                if _tensor_like(arg) and not (_moves_to_cpu(arg) or _root(arg) in moved):
                    bad.append(f"{path}:{n.lineno}: np.{n.func.attr}(<tensor>) without a move "
                               "to the CPU")
    return sorted(set(bad))


def test_no_device_tensor_reaches_numpy():
    bad = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "tpkit")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                bad += check_source(open(path).read(), os.path.relpath(path, ROOT))
    assert not bad, "\n".join(bad)


def test_check_flags_device_conversions():
    flagged = [
        "def f(t):\n    return t.numpy()\n",
        "def f(t):\n    return t.reshape(-1).view(torch.uint8).numpy().data\n",
        "def f(t):\n    t = t.to(torch.float16)\n    return t.numpy()\n",
        "def f(t):\n    return np.asarray(t.detach())\n",
        "def f(t):\n    return np.array(t.float(), np.float32)\n",
    ]
    clean = [
        "def f(t):\n    return t.cpu().numpy()\n",
        "def f(t):\n    return t.detach().to('cpu').numpy()\n",
        "def f(t):\n    t = t.to(device='cpu', dtype=x).contiguous()\n"
        "    return t.reshape(-1).numpy()\n",
        "def f(t):\n    return np.asarray(t.detach().cpu())\n",
        "def f(xs):\n    return np.asarray(xs, np.int64)\n",
        "def f(t):\n    return t.tolist()\n",
    ]
    for src in flagged:
        assert check_source(src), src
    for src in clean:
        assert not check_source(src), src
    hf = open(os.path.join(ROOT, "tpkit", "models", "hf.py")).read()
    assert 'device="cpu", ' in hf
    assert check_source(hf.replace('device="cpu", ', ""), "hf.py")   # the defect
