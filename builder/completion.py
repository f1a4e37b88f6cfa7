"""``cudaenv completion bash|zsh|fish``: shell completion made from the argument parser itself,
so a new command or option completes without anything to keep in step."""

from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash", "zsh", "fish")


def _commands(parser: argparse.ArgumentParser) -> dict[str, tuple[list[str], str]]:
    """command -> (its options, its one-line help)."""
    out: dict[str, tuple[list[str], str]] = {}
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                options = sorted(
                    o
                    for a in sub._actions
                    if a.help != argparse.SUPPRESS
                    for o in a.option_strings
                    if o.startswith("--")
                )
                out[name] = (options, helps.get(name, ""))
    return out


def _bash(parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    cases = "\n".join(
        f"        {name}) opts={shlex.quote(' '.join(options))} ;;"
        for name, (options, _) in sorted(commands.items())
    )
    names = " ".join(sorted(commands))
    return f"""# cudaenv completion for bash (and zsh through bashcompinit)
_cudaenv() {{
    # Slices, not indexes: the same in bash and in zsh (whose arrays start at 1).
    local cur="${{COMP_WORDS[@]:$COMP_CWORD:1}}" cmd="" opts="" w
    for w in "${{COMP_WORDS[@]:1:$((COMP_CWORD - 1))}}"; do
        case "$w" in -*) ;; *) cmd="$w"; break ;; esac
    done
    if [ -z "$cmd" ]; then
        COMPREPLY=($(compgen -W "{names} --help --version --debug --quiet" -- "$cur"))
        return
    fi
    case "$cmd" in
{cases}
    esac
    if [[ "$cur" == -* ]]; then
        COMPREPLY=($(compgen -W "$opts --help --debug --quiet" -- "$cur"))
    else
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
}}
complete -o filenames -F _cudaenv cudaenv
"""


def _zsh(parser: argparse.ArgumentParser) -> str:
    return "# cudaenv completion for zsh\nautoload -U +X bashcompinit && bashcompinit\n" + _bash(
        parser
    )


def _fish(parser: argparse.ArgumentParser) -> str:
    lines = ["# cudaenv completion for fish", "complete -c cudaenv -f"]
    for name, (options, summary) in sorted(_commands(parser).items()):
        desc = summary.replace("'", "\\'")
        lines.append(f"complete -c cudaenv -n __fish_use_subcommand -a {name} -d '{desc}'")
        for option in options:
            lines.append(
                f"complete -c cudaenv -n '__fish_seen_subcommand_from {name}' -l {option[2:]}"
            )
        lines.append(f"complete -c cudaenv -n '__fish_seen_subcommand_from {name}' -F")
    return "\n".join(lines) + "\n"


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](parser)
