"""``cudaenv completion bash|zsh|fish``: shell completion made from the argument parser itself,
so a new command or option completes without anything to keep in step.

What each command's arguments complete to: its long options after ``-``; a command with
subcommands (``store``, ``report``) or a positional of fixed choices (``completion``'s shell)
those words; ``remove`` and ``run`` (its first argument) the names of the envs built here, as
``cudaenv completion --env-names`` prints them; anything else file names."""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass

SHELLS = ("bash", "zsh", "fish")

# Commands whose NAME arguments are env names: every one of remove's, run's first only (what
# follows is the command to run, which completes to file names).
ENV_NAMES_ALL = ("remove",)
ENV_NAMES_FIRST = ("run",)


@dataclass(frozen=True)
class _Command:
    options: tuple[str, ...]  # its long options, --help among them
    summary: str
    words: tuple[tuple[str, str], ...]  # (word, summary): its subcommands or its choices
    nested: bool  # words are subcommands, with options of their own ("store gc")


def _subparsers(
    parser: argparse.ArgumentParser,
) -> argparse._SubParsersAction[argparse.ArgumentParser] | None:
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _commands(parser: argparse.ArgumentParser) -> dict[str, _Command]:
    """Every command and subcommand ("store gc"), by its words."""
    out: dict[str, _Command] = {}

    def walk(parent: argparse.ArgumentParser, prefix: str) -> None:
        sub = _subparsers(parent)
        if sub is None:
            return
        helps = {a.dest: a.help or "" for a in sub._choices_actions}
        for name, child in sub.choices.items():
            key = f"{prefix} {name}".strip()
            options = tuple(
                sorted(
                    {
                        o
                        for a in child._actions
                        if a.help != argparse.SUPPRESS
                        for o in a.option_strings
                        if o.startswith("--")
                    }
                )
            )
            inner = _subparsers(child)
            words: tuple[tuple[str, str], ...] = ()
            if inner is not None:
                inner_helps = {a.dest: a.help or "" for a in inner._choices_actions}
                words = tuple((n, inner_helps.get(n, "")) for n in inner.choices)
            else:
                choices = [a.choices for a in child._actions if not a.option_strings and a.choices]
                if choices:
                    words = tuple((str(c), "") for c in choices[0])
            out[key] = _Command(options, helps.get(name, ""), words, inner is not None)
            walk(child, key)

    walk(parser, "")
    return out


def _bash(parser: argparse.ArgumentParser) -> str:
    commands = _commands(parser)
    cases = []
    for key, command in sorted(commands.items()):
        line = f"opts={shlex.quote(' '.join(command.options))}"
        if command.words:
            line += f" words={shlex.quote(' '.join(w for w, _ in command.words))}"
        if key in ENV_NAMES_ALL:
            line += " kind=envs"
        elif key in ENV_NAMES_FIRST:
            line += " kind=run"
        cases.append(f"        {shlex.quote(key)}) {line} ;;")
    names = " ".join(sorted(k for k in commands if " " not in k))
    nested = "|".join(sorted(k for k, c in commands.items() if c.nested)) or "''"
    return f"""# cudaenv completion for bash (and zsh through bashcompinit)
_cudaenv() {{
    # Slices, not indexes: the same in bash and in zsh (whose arrays start at 1).
    local cur="${{COMP_WORDS[@]:$COMP_CWORD:1}}" cmd="" sub="" key="" opts="" words=""
    local kind=files n=0 after=0 w
    for w in "${{COMP_WORDS[@]:1:$((COMP_CWORD - 1))}}"; do
        case "$w" in
            --) after=1 ;;
            -*) ;;
            *)
                n=$((n + 1))
                if [ $n -eq 1 ]; then cmd="$w"; elif [ $n -eq 2 ]; then sub="$w"; fi
                ;;
        esac
    done
    if [ -z "$cmd" ]; then
        COMPREPLY=($(compgen -W "{names} --help --version --debug --quiet" -- "$cur"))
        return
    fi
    key="$cmd"
    case "$cmd" in
        {nested}) [ -n "$sub" ] && key="$cmd $sub" ;;
    esac
    case "$key" in
{chr(10).join(cases)}
    esac
    if [ "$kind" = run ] && {{ [ $n -ge 2 ] || [ $after -eq 1 ]; }}; then
        # After the env's name: the command to run and its arguments.
        COMPREPLY=($(compgen -f -- "$cur"))
    elif [[ "$cur" == -* ]]; then
        # --help is among each command's own options; --debug and --quiet are hidden there.
        COMPREPLY=($(compgen -W "$opts --debug --quiet" -- "$cur"))
    elif [ -n "$words" ] && [ $n -eq 1 ]; then
        COMPREPLY=($(compgen -W "$words" -- "$cur"))
    elif [ "$kind" != files ]; then
        COMPREPLY=($(compgen -W "$(command cudaenv completion --env-names 2>/dev/null)" -- "$cur"))
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


_FISH_HELPERS = """\
function __cudaenv_args --description 'the words so far that are not options'
    for w in (commandline -opc)[2..-1]
        string match -q -- '-*' $w; or echo $w
    end
end
function __cudaenv_at --description 'the words so far are exactly these'
    set -l words (__cudaenv_args)
    test "$words" = "$argv"
end
function __cudaenv_in --description 'the words so far begin with these'
    set -l words (__cudaenv_args)
    set -l n (count $argv)
    test (count $words) -ge $n; and test "$words[1..$n]" = "$argv"
end"""


def _fish_quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _fish(parser: argparse.ArgumentParser) -> str:
    lines = ["# cudaenv completion for fish", "complete -c cudaenv -f", _FISH_HELPERS]
    envs = "(cudaenv completion --env-names 2>/dev/null)"
    for key, command in sorted(_commands(parser).items()):
        if " " not in key:
            lines.append(
                f"complete -c cudaenv -n __cudaenv_at -a {key} -d {_fish_quote(command.summary)}"
            )
        # A command with subcommands has its own options only before one is given; each
        # subcommand has its own (else `store gc --` would offer --help twice).
        where = f"__cudaenv_at {key}" if command.nested else f"__cudaenv_in {key}"
        for option in command.options:
            lines.append(f"complete -c cudaenv -n {_fish_quote(where)} -l {option[2:]}")
        for word, summary in command.words:
            lines.append(
                f"complete -c cudaenv -n {_fish_quote(f'__cudaenv_at {key}')} -a {word}"
                + (f" -d {_fish_quote(summary)}" if summary else "")
            )
        if key in ENV_NAMES_ALL:
            lines.append(f"complete -c cudaenv -n '__cudaenv_in {key}' -a '{envs}'")
        elif key in ENV_NAMES_FIRST:
            lines.append(f"complete -c cudaenv -n '__cudaenv_at {key}' -a '{envs}'")
            lines.append(
                f"complete -c cudaenv -n '__cudaenv_in {key}; and not __cudaenv_at {key}' -F"
            )
        elif not command.words:
            lines.append(f"complete -c cudaenv -n '__cudaenv_in {key}' -F")
    return "\n".join(lines) + "\n"


def script(shell: str, parser: argparse.ArgumentParser) -> str:
    return {"bash": _bash, "zsh": _zsh, "fish": _fish}[shell](parser)
