"""Grammars of the config values that reach a shell, a unit file or nginx: one source for each rule.

Each check returns None for a valid value, else the fix to show. config.py reports the fix
with the key and the value; renderers may call the same check as a last guard. Grammars are
deliberately narrow: a value with a known shape never needs shell metacharacters, so `;`,
`$`, backticks, quotes, spaces and newlines are refused here, and the quoting filter
(templates.shell_quote) is the second line of defence, not the only one.
"""

from __future__ import annotations

import ipaddress
import re
from functools import lru_cache
from pathlib import Path


_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")
DNS_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
EMAIL = re.compile(rf"[A-Za-z0-9._%+-]{{1,64}}@{_HOST_LABEL}(?:\.{_HOST_LABEL})+")
# Docker reference: [registry[:port]/]path[:tag][@sha256:digest] (distribution/reference grammar, lower-case path).
IMAGE_REF = re.compile(
    r"(?:(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*(?::[0-9]+)?)/)?"
    r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[a-f0-9]{64})?", re.ASCII)
ABS_PATH = re.compile(r"/(?:[A-Za-z0-9._+-]+/?)*")
LOCAL_PATH = re.compile(r"[A-Za-z0-9._+/~-]+")
SYSCTL_NAME = re.compile(r"[a-z0-9_-]+(?:\.[a-z0-9_-]+)+")
SYSCTL_VALUE = re.compile(r"[A-Za-z0-9_.:,/+-]+(?: [A-Za-z0-9_.:,/+-]+)*")
URL = re.compile(r"https?://[A-Za-z0-9.-]+(?::[0-9]{1,5})?(?:/(?:[A-Za-z0-9._~/+-]|%[0-9A-Fa-f]{2})*)?")
_URL_CHARS = r"(?:[A-Za-z0-9._~!&()*+,;=:@/-]|%[0-9A-Fa-f]{2})"
WEBHOOK_URL = re.compile(rf"https?://(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{{1,5}})?(?:/{_URL_CHARS}*)?"
                         rf"(?:\?(?:{_URL_CHARS}|\?)*)?")
"""An RFC 3986 URL with a query (chat webhooks carry tokens there): '%' only as an escape, no
quotes, backslashes, '$', spaces or fragments; what Go's url.Parse in Alertmanager accepts."""
SERVED_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(?:/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")
UNIX_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
ENV_NAME = re.compile(r"[A-Z_][A-Z0-9_]{0,127}")
ENV_VALUE = re.compile(r"[A-Za-z0-9_.:,/=+@%|-]{0,1024}")
KEY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
API_KEY = re.compile(r"(?=.{24,512}\Z)[A-Za-z0-9._~+/-]+=*")
"""RFC 6750 b64token ('=' only as padding at the end), 24-512 characters: nothing in it needs
quoting in nginx, and only '.' and '+' are special in a regex."""
NO_CONTROL = re.compile(r"[^\x00-\x1f\x7f]*")
HF_TOKEN = re.compile(r"[A-Za-z0-9_.-]{8,512}")
"""A Hugging Face access token (hf_ and letters): one line of the engine's env file, nothing
systemd's EnvironmentFile reads as a quote, an escape or a second variable."""
TEXT = re.compile("[^\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]{0,4096}")
"""Any config string, before its own grammar: one line (no control character, C1 code, Unicode
line or paragraph separator) of encodable text (no lone surrogate), 4096 characters at most."""
SSH_PUBLIC_KEY = re.compile(r"(ssh-ed25519|ecdsa-sha2-nistp(256|384|521)|ssh-rsa|rsa-sha2-(256|512)) [A-Za-z0-9+/]+={0,3}( [^\x00-\x1f\x7f]*)?")

THP_NAMES = re.compile(r".*(transparent_hugepage|khugepaged|(^|[._])thp([._]|$)).*")
"""THP lives in sysfs (/sys/kernel/mm/transparent_hugepage), never in sysctl; fimfleet sets it itself."""


@lru_cache(maxsize=1)
def known_sysctls() -> frozenset[str]:
    """Writable sysctl names of a current Linux (find /proc/sys -type f -perm -200): a misspelt,
    removed or read-only name fails at preview."""
    text = (Path(__file__).with_name("data") / "sysctl-keys.txt").read_text()
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


def _full(pattern: re.Pattern, value) -> bool:
    return isinstance(value, str) and pattern.fullmatch(value) is not None


GPU_MODEL = re.compile(r"(?=.{1,32}\Z)[A-Za-z0-9]+(?:[ ._-][A-Za-z0-9]+)*")


def gpu_model(v) -> str | None:
    """A GPU model as nvidia-smi's name holds it (H100, L40S, RTX 6000 Ada); "" on a CPU host.
    The preflight matches its words against the GPU's name: a name with no word matched any GPU."""
    return None if v == "" or _full(GPU_MODEL, v) else \
        "must be a GPU model of words of letters and digits, like H100, L40S or RTX 6000 Ada (32 characters at most)"


TEXT_FIX = ("must be printable text on one line, at most 4096 characters (no control characters, line breaks "
            "or unpaired surrogates)")


def text(v) -> list[tuple[str, str, str]]:
    """The rule for every string a section holds, in its lists and maps too, beneath its own
    grammar (config._parse_section): (key suffix, the string, the fix) for each that breaks it."""
    return [(where, s, TEXT_FIX) for where, s in _strings(v, "") if not _full(TEXT, s)]


def _strings(v, where: str):
    if isinstance(v, str):
        yield where, v
    elif isinstance(v, (list, tuple)):
        for i, item in enumerate(v):
            yield from _strings(item, f"{where}[{i}]")
    elif isinstance(v, dict):
        for k, item in v.items():
            yield from _strings(k, f"{where}.{k}")
            yield from _strings(item, f"{where}.{k}")


def hostname(v) -> str | None:
    if _full(HOSTNAME, v) and not v.replace(".", "").isdigit():
        return None
    return "must be a DNS name like code.example.com (letters, digits, - and dots; no scheme, port, path or spaces)"


IP_CHARS = re.compile(r"[0-9A-Fa-f:.]{2,45}")
"""What an IP address is written with: no zone (`fe80::1%eth0`, where anything may follow the %),
no other script's digits. Checked before ipaddress, which takes both."""


def parsed_ip(v) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `v` spells, or None: the one parse behind every IP rule here."""
    if not _full(IP_CHARS, v):  # ipaddress also takes an int (3232235521) or a bool as an address
        return None
    try:
        return ipaddress.ip_address(v)
    except ValueError:
        return None


def ip(v) -> bool:
    return parsed_ip(v) is not None


def url_host(host: str) -> str:
    """A host as a URL names it: an IPv6 address in brackets (RFC 3986), anything else as it is."""
    a = parsed_ip(host)
    return f"[{a}]" if a is not None and a.version == 6 else host


def same_host(address) -> str:
    """One spelling per machine: IP addresses compressed (an IPv4-mapped one as IPv4), names in
    lower case without the root dot (VPS1.example.com., vps1.example.com; 2001:DB8:0:0::1, 2001:db8::1)."""
    if not isinstance(address, str):
        return repr(address)
    a = parsed_ip(address)
    if a is None:
        return address.lower().rstrip(".")
    return str(getattr(a, "ipv4_mapped", None) or a.compressed)


def address(v) -> str | None:
    """An IP address or a DNS name: where SSH connects, and what a certificate names."""
    a = parsed_ip(v)
    if a is not None:
        a = getattr(a, "ipv4_mapped", None) or a
        if a.is_unspecified or a.is_multicast:
            return f"names no single machine ({'unspecified' if a.is_unspecified else 'multicast'}); use the host's own address"
        return None
    return None if hostname(v) is None else "must be an IP address (203.0.113.10) or a DNS name (vps1.example.com)"


CIDR_CHARS = re.compile(r"[0-9A-Fa-f:.]{2,45}/[0-9]{1,3}")


def cidr(v, opens: str = "/metrics") -> str | None:
    """A network in canonical form, never the whole internet (`opens`: what it lets in)."""
    if not isinstance(v, str):
        return "must be a CIDR string like 10.0.0.0/8 or 198.51.100.7/32"
    if not _full(CIDR_CHARS, v):
        return "must be a CIDR like 10.0.0.0/8 or 2001:db8::/32 (hex digits, : and . , then /length; no zone or spaces)"
    try:
        net = ipaddress.ip_network(v, strict=True)
    except (ValueError, TypeError) as e:
        if isinstance(v, str) and "host bits set" in str(e):
            fixed = ipaddress.ip_network(v, strict=False)
            return f"has host bits set; write the network address: {fixed}"
        return "must be a CIDR like 10.0.0.0/8 or 192.168.1.0/24"
    if net.prefixlen == 0:
        return f"opens {opens} to the whole internet; list only your own networks (e.g. 10.0.0.0/8 or 198.51.100.7/32)"
    return None


WORLD = {4: ipaddress.ip_network("0.0.0.0/0"), 6: ipaddress.ip_network("::/0")}
V4_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
V6_GLOBAL = ipaddress.ip_network("2000::/3")
"""Every global unicast IPv6 address: a set that covers it is open to the whole IPv6 internet."""


def world_open(networks) -> list[str]:
    """Which of 0.0.0.0/0 and ::/0 the networks cover together (0.0.0.0/1 + 128.0.0.0/1 count,
    and so do the IPv4-mapped IPv6 range and 2000::/3, every global IPv6 address)."""
    v4 = [n for n in networks if n.version == 4]
    v6 = [n for n in networks if n.version == 6]
    for n in v6:
        if V4_MAPPED.subnet_of(n):
            v4.append(WORLD[4])
        elif n.subnet_of(V4_MAPPED):
            v4.append(ipaddress.IPv4Network((int(n.network_address) & 0xFFFFFFFF, n.prefixlen - 96)))
    return [str(WORLD[f]) for f, group in ((4, v4), (6, v6))
            if any(n.prefixlen == 0 or (n.version == 6 and V6_GLOBAL.subnet_of(n)) for n in ipaddress.collapse_addresses(group))]


def cidr_set(values, opens: str) -> list[tuple[str, object, str]]:
    """(key suffix, value, problem) for a list of networks taken as one set: each one's own grammar
    ("[i]", the item), a repeat of an earlier one (however spelt: EC2 refuses a rule that names it
    twice), and the whole internet covered together ("", the list). `opens`: what they let in."""
    out, seen = [], {}
    for i, v in enumerate(values):
        if msg := cidr(v, opens):
            out.append((f"[{i}]", v, msg))
            continue
        net = ipaddress.ip_network(v)
        if net in seen:
            out.append((f"[{i}]", v, f"repeats [{seen[net]}] ({net}); list each network once"))
        seen.setdefault(net, i)
    if world := world_open(list(seen)):
        out.append(("", values, f"together these cover {' and '.join(world)}, the whole internet, which opens {opens} "
                                "to anyone; list only your own networks (e.g. 198.51.100.7/32)"))
    return out


def email(v) -> str | None:
    return None if _full(EMAIL, v) else "must be an e-mail address like ops@example.com"


def image(v) -> str | None:
    if _full(IMAGE_REF, v):
        return None
    return ("must be an image reference like registry.example.com/vllm/vllm-openai:v0.32.0 "
            "or repo@sha256:<64 hex> (lower-case path, no spaces or shell characters)")


REGISTRY_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,254}")


def image_registry(ref: str) -> str:
    """The registry host[:port] an image reference names; Docker Hub's own key for short names."""
    first = ref.split("/", 1)[0] if "/" in ref else ""
    return first if ("." in first or ":" in first or first == "localhost") else "https://index.docker.io/v1/"


def registry_user(v) -> str | None:
    if _full(REGISTRY_USER, v):
        return None
    return "must be a registry user name of letters, digits and ._@+- (e.g. acme-bot, AWS)"


SYSTEM_DIRS = frozenset({
    "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/libx32", "/media", "/mnt", "/opt",
    "/proc", "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var",
    "/usr/bin", "/usr/games", "/usr/include", "/usr/lib", "/usr/lib32", "/usr/lib64", "/usr/libexec", "/usr/libx32",
    "/usr/local", "/usr/sbin", "/usr/share", "/usr/src", "/usr/local/bin", "/usr/local/etc", "/usr/local/include",
    "/usr/local/lib", "/usr/local/sbin", "/usr/local/share", "/usr/local/src", "/var/backups", "/var/cache",
    "/var/lib", "/var/local", "/var/lock", "/var/log", "/var/mail", "/var/opt", "/var/run", "/var/spool",
    "/var/tmp", "/var/www"})
"""Directories of the distribution itself (FHS): never a directory fimfleet may replace or delete."""
VOLATILE_DIRS = ("/proc/", "/sys/", "/dev/", "/run/", "/tmp/", "/boot/")
"""Kernel views, tmpfs and the boot partition: no place for a venv."""


def abs_path(v) -> str | None:
    """A canonical absolute path: no `.` or `..` part, no `//`, no trailing `/` (a renderer appends
    `.new` or `/bin/python` to it), never / itself."""
    if _full(ABS_PATH, v) and v != "/" and not v.endswith("/") and "//" not in v \
            and not {".", ".."} & set(v.split("/")):
        return None
    return ("must be an absolute path of letters, digits and ._+- without `.` or `..` parts, `//` or a trailing / "
            "(e.g. /opt/fimfleet/vllm), not / itself")


def owned_dir(v) -> str | None:
    """A directory fimfleet creates, replaces and deletes (the runtime's venv): never a system one."""
    if (fix := abs_path(v)) is not None:
        return fix
    if v in SYSTEM_DIRS or (v + "/").startswith(VOLATILE_DIRS):
        return ("is a system directory, or lies under /proc, /sys, /dev, /run, /tmp or /boot: fimfleet replaces this "
                "directory on install and deletes it on destroy; use a directory of its own, e.g. /opt/fimfleet/vllm")
    return None


def local_path(v) -> str | None:
    return None if _full(LOCAL_PATH, v) else "must be a path of letters, digits and ._+/~- (no spaces or shell characters)"


def sysctl_name(v) -> str | None:
    if not _full(SYSCTL_NAME, v):
        return "not a sysctl name (dotted, e.g. vm.swappiness)"
    if THP_NAMES.fullmatch(v):
        return ("transparent huge pages are not a sysctl; fimfleet sets THP in sysfs itself "
                "(madvise); remove this key")
    if v not in known_sysctls():
        return ("no such sysctl in current Linux kernels (misspelt or removed), or a read-only one like fs.file-nr; "
                "check the name with `sysctl -a` on the host")
    return None


def sysctl_value(v) -> str | None:
    if isinstance(v, float):
        return "must be a whole number (the kernel takes no decimals), or words like `4096 87380 16777216`"
    s = str(v) if isinstance(v, int) and not isinstance(v, bool) else v
    if not _full(SYSCTL_VALUE, s):
        return "must be a number or words of letters, digits and ._:,/+- separated by single spaces"
    # The kernel's widest integers (long, unsigned long): a number past them is no value of any
    # sysctl. Each sysctl's own range is the kernel's to check (the apply tries the values first).
    if any(re.fullmatch(r"[+-]?[0-9]+", w) and not -2**63 <= int(w) < 2**64 for w in s.split()):
        return "holds a number past the kernel's 64-bit range; use the value the sysctl takes (`sysctl NAME` shows it)"
    return None


def _url_authority(v: str) -> str | None:
    """The host and port of a URL its pattern matched: a host `address` takes, a port 1-65535."""
    from urllib.parse import urlsplit

    parts = urlsplit(v)
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port is not None and not 1 <= port <= 65535:
        return "its port must be between 1 and 65535"
    host = parts.hostname or ""
    if address(host) is not None:
        return f"its host {host!r} must be a DNS name or an IP address"
    return None


def _url(pattern: re.Pattern, v, fix: str) -> str | None:
    if not _full(pattern, v):
        return fix
    msg = _url_authority(v)
    return None if msg is None else f"{fix}; {msg}"


def url(v) -> str | None:
    fix = "must be an http(s) URL like https://pypi.example.com/simple (no spaces or quotes)"
    return _url(URL, v, fix)


def webhook_url(v) -> str | None:
    fix = ("must be an http(s) URL like https://hooks.example.com/services/T0/B0/x?token=y "
           "('%' only before two hex digits; no spaces, quotes, backslashes or '#')")
    return _url(WEBHOOK_URL, v, fix)


def served_name(v) -> str | None:
    return None if _full(SERVED_NAME, v) else "must be letters, digits and ._- (1-128 chars), e.g. qwen2.5-coder-7b"


def model_id(v) -> str | None:
    return None if _full(MODEL_ID, v) else "must be a Hugging Face id like Qwen/Qwen2.5-Coder-7B"


def revision(v) -> str | None:
    return None if _full(REVISION, v) else "must be a branch, tag or commit of letters, digits and ._/-"


def unix_user(v) -> str | None:
    return None if _full(UNIX_USER, v) else "must be a Unix user name like root or deploy"


def env_name(v) -> str | None:
    return None if _full(ENV_NAME, v) else "environment names are UPPER_CASE letters, digits and _"


def env_value(v) -> str | None:
    s = str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return None if _full(ENV_VALUE, s) else "values are letters, digits and _.:,/=+@%|- (no spaces, quotes or newlines)"


def key_name(v) -> str | None:
    return None if _full(KEY_NAME, v) else "key names are identifiers: letters, digits and _ (1-63 chars, not starting with a digit)"


def api_key(v) -> str | None:
    return None if _full(API_KEY, v) else ("each key must be 24-512 URL-safe characters (letters, digits, -._~+/, '=' padding at the end), "
                                              "no spaces or quotes (e.g. openssl rand -hex 24)")


def ssh_public_key(v) -> str | None:
    fix = ("must be one SSH public key line like `ssh-ed25519 AAAA...` "
           "(ssh-keyscan -t ed25519 HOST prints it; check its fingerprint on the console)")
    if not _full(SSH_PUBLIC_KEY, v):
        return fix
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization

    kind, b64 = v.split()[:2]
    try:  # the key data decoded and parsed whole (RFC 4253), and of the type the line names
        serialization.load_ssh_public_key(f"{'ssh-rsa' if kind.startswith('rsa-sha2-') else kind} {b64}".encode())
    except (ValueError, UnsupportedAlgorithm):
        return fix + f"; this one's key data is cut, damaged or not a {kind} key"
    return None


def dns_label(v) -> str | None:
    return None if _full(DNS_LABEL, v) else "must be a DNS label: lower-case letters, digits and -, 1-63 chars"


TYPE_WORDS = {int: "a whole number", float: "a number", str: "a string", bool: "true or false", list: "a list", dict: "a map"}


def wrong_type(want: type, v) -> str:
    """The fix for a value of the wrong type. `pulumi config set --path` stores only integers,
    true and false as such, so a decimal typed that way arrives as text: say how to set it."""
    fix = f"must be {TYPE_WORDS.get(want, want.__name__)}"
    if want is list:
        return fix + ", e.g. [a, b] in the stack file, or set each item with `pulumi config set --path 'KEY[0]' a`"
    if want is dict:
        return fix + ", e.g. {NAME: value} in the stack file, or set each entry with `pulumi config set --path KEY.NAME value`"
    if want in (int, float) and isinstance(v, str):
        try:
            want(v.strip())
        except ValueError:
            return fix
        fix += (f", not the text {v!r}: write it unquoted in the stack file, or set it with "
                f"`pulumi config set --path KEY {v.strip()} --type {want.__name__}` (without --type, "
                "--path keeps a decimal as text)")
    return fix
