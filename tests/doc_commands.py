"""The commands of the documentation's shell blocks, checked without running them: each block's
shell lines (heredoc bodies and comments left out, continuations joined), their simple commands,
and for each replica program or tools/ script the flags it uses against what the program accepts
(its --help for replica programs, its source for scripts). tests/doc_test.py runs the rest."""
import os
import re
import shlex
import subprocess


def command_lines(body):
    """The shell lines of a block, heredoc bodies and comments left out, continuations joined."""
    out, heredoc, pending = [], None, ""
    for raw in body.split("\n"):
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        line = pending + raw
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        m = re.search(r"<<-?\s*'?\"?(\w+)'?\"?", line)
        if m:
            heredoc = m.group(1)
            line = line[: m.start()]
        if line.strip() and not line.strip().startswith("#"):
            out.append(line)
    return out


def segments(line):
    """Simple commands of a line: split at && || | ; and shell keywords."""
    try:
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        tokens = list(lex)
    except ValueError:
        return []
    segs, cur = [], []
    for t in tokens:
        if t in (";", "&&", "||", "|", "&", ";;"):
            segs.append(cur)
            cur = []
        elif not cur and t in ("do", "then", "else", "for", "while", "if", "done", "fi"):
            if t == "for":
                cur = ["for"]
            continue
        else:
            cur.append(t)
    segs.append(cur)
    return [s for s in segs if s and s[0] != "for"]


class Programs:
    """What a program accepts: its --help text for replica programs, its source for scripts."""

    def __init__(self, repo, bindir):
        self.repo, self.bindir, self.cache = repo, bindir, {}

    def flags(self, name):
        if name in self.cache:
            return self.cache[name]
        result = None
        if name.startswith("replica-"):
            exe = os.path.join(self.bindir, name)
            if os.access(exe, os.X_OK):
                p = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=30)
                result = ("help", set(re.findall(r"--[A-Za-z0-9][-A-Za-z0-9_]*", p.stdout)))
        else:
            src = os.path.join(self.repo, name)
            if os.path.isfile(src):
                with open(src, errors="replace") as f:
                    result = ("source", f.read())
        self.cache[name] = result
        return result


def program_name(token):
    base = os.path.basename(token)
    if base.startswith("replica-"):
        return base
    if token.startswith("tools/") or token.startswith("./tools/"):
        return token.lstrip("./")
    return None


def check_command(tokens, programs):
    """Problems with one simple command, as messages."""
    while tokens and (re.match(r"^\w+=", tokens[0]) or tokens[0] in ("env", "sudo", "time", "exec")):
        tokens = tokens[1:]
    if tokens and tokens[0] in ("python3", "bash", "sh"):
        tokens = tokens[1:]
    if not tokens:
        return []
    name = program_name(tokens[0])
    if name is None:
        return []
    known = programs.flags(name)
    if known is None:
        return [f"'{tokens[0]}': no such program (looked for {name})"]
    _, what = known
    problems, rest = [], tokens[1:]
    for i, t in enumerate(rest):
        if t == "--":
            after = rest[i + 1:]
            if name == "replica-dp-vs-ddp":  # what follows -- goes to replica-train
                after = ["replica-train"] + after
            return problems + check_command(after, programs)
        if t.startswith("--") and len(t) > 2:
            flag = t.split("=", 1)[0]
            if flag not in what:  # a --help's flag set, or a script's source text
                problems.append(f"{name}: unknown flag {flag}")
    return problems
