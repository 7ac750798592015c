"""Built-in corpus of realistic Fill-in-the-Middle (FIM) cases for the SLA probe.

Each case is the text before the cursor (``prefix``) and after it (``suffix``) in a
small, plausible source file, the way an editor plugin (Continue.dev, Cursor) sends
it. The probe never sends a case twice with the same prefix: ``build_prompt`` puts a
unique comment line at the very *start* of the prefix, so vLLM's automatic prefix
caching cannot reuse a single KV block from an earlier request and flatter TTFT.

Prompts are kept short on purpose (see ``max_chars``): on the emulated test VM TTFT
grows with prompt length, and an SLA probe should measure the serving path, not
how long a 4k-token prompt takes to prefill on a slow CPU.

Pure data and pure functions: no Pulumi, no network. The FIM prompt format is applied
in one place, ``fim_prompt``.
"""

from __future__ import annotations

from dataclasses import dataclass

from components import models

def fim_prompt(prefix: str, suffix: str) -> str:
    """The corpus's prompts in the served model's FIM format (components/models.py, the one source)."""
    return models.QWEN_FIM.prompt(prefix, suffix)


@dataclass(frozen=True)
class FimCase:
    """One FIM completion site."""

    name: str
    """Short identifier, unique within the corpus (``python/moving_average``)."""
    language: str
    """Language name, for reports."""
    comment: str
    """Line-comment marker of the language, used for the unique first line."""
    prefix: str
    """Code before the cursor."""
    suffix: str
    """Code after the cursor."""


def _case(language: str, slug: str, comment: str, prefix: str, suffix: str) -> FimCase:
    return FimCase(f"{language}/{slug}", language, comment, prefix, suffix)


CORPUS: tuple[FimCase, ...] = (
    _case(
        "python", "moving_average", "#",
        'from collections import deque\n\n\n'
        'def moving_average(values, window):\n'
        '    """Yield the mean of the last `window` values."""\n'
        '    if window <= 0:\n'
        '        raise ValueError("window must be positive")\n'
        '    buf = deque(maxlen=window)\n'
        '    total = 0.0\n'
        '    for v in values:\n'
        '        if len(buf) == window:\n'
        '            total -= buf[0]\n',
        '        yield total / len(buf)\n\n\n'
        'if __name__ == "__main__":\n'
        '    print(list(moving_average([1, 2, 3, 4], 2)))\n',
    ),
    _case(
        "python", "config_loader", "#",
        'import json\nimport os\nfrom dataclasses import dataclass\n\n\n'
        '@dataclass\nclass Settings:\n    host: str\n    port: int\n    debug: bool = False\n\n\n'
        'def load_settings(path: str) -> Settings:\n'
        '    with open(path, encoding="utf-8") as fh:\n'
        '        raw = json.load(fh)\n'
        '    port = int(os.environ.get("PORT", raw.get("port", 8080)))\n'
        '    return Settings(\n',
        '    )\n\n\n'
        'def main() -> None:\n'
        '    settings = load_settings("settings.json")\n'
        '    print(settings)\n',
    ),
    _case(
        "typescript", "debounce", "//",
        'export function debounce<T extends (...args: any[]) => void>(\n'
        '  fn: T,\n  waitMs: number,\n): (...args: Parameters<T>) => void {\n'
        '  let timer: ReturnType<typeof setTimeout> | undefined;\n'
        '  return (...args: Parameters<T>) => {\n'
        '    if (timer !== undefined) {\n',
        '    }\n'
        '    timer = setTimeout(() => fn(...args), waitMs);\n'
        '  };\n}\n',
    ),
    _case(
        "typescript", "fetch_retry", "//",
        'interface RetryOptions {\n  retries: number;\n  backoffMs: number;\n}\n\n'
        'export async function fetchWithRetry(\n  url: string,\n  opts: RetryOptions,\n'
        '): Promise<Response> {\n'
        '  let lastError: unknown;\n'
        '  for (let attempt = 0; attempt <= opts.retries; attempt++) {\n'
        '    try {\n'
        '      const res = await fetch(url);\n'
        '      if (res.ok) return res;\n',
        '    } catch (err) {\n      lastError = err;\n    }\n'
        '    await new Promise((r) => setTimeout(r, opts.backoffMs * 2 ** attempt));\n'
        '  }\n  throw lastError;\n}\n',
    ),
    _case(
        "go", "json_handler", "//",
        'package api\n\nimport (\n\t"encoding/json"\n\t"net/http"\n)\n\n'
        'type createUserRequest struct {\n\tName  string `json:"name"`\n\tEmail string `json:"email"`\n}\n\n'
        'func (s *Server) handleCreateUser(w http.ResponseWriter, r *http.Request) {\n'
        '\tvar req createUserRequest\n'
        '\tif err := json.NewDecoder(r.Body).Decode(&req); err != nil {\n',
        '\t}\n'
        '\tuser, err := s.store.CreateUser(r.Context(), req.Name, req.Email)\n'
        '\tif err != nil {\n\t\thttp.Error(w, err.Error(), http.StatusInternalServerError)\n\t\treturn\n\t}\n'
        '\tw.WriteHeader(http.StatusCreated)\n\t_ = json.NewEncoder(w).Encode(user)\n}\n',
    ),
    _case(
        "go", "worker_pool", "//",
        'package pool\n\nimport "sync"\n\n'
        '// Run calls fn for every item using n goroutines and waits for all of them.\n'
        'func Run[T any](items []T, n int, fn func(T)) {\n'
        '\tvar wg sync.WaitGroup\n'
        '\tch := make(chan T)\n'
        '\tfor i := 0; i < n; i++ {\n',
        '\t}\n'
        '\tfor _, it := range items {\n\t\tch <- it\n\t}\n'
        '\tclose(ch)\n\twg.Wait()\n}\n',
    ),
    _case(
        "rust", "parse_kv", "//",
        'use std::collections::HashMap;\n\n'
        '/// Parse `key=value` lines, skipping blanks and `#` comments.\n'
        'pub fn parse_kv(input: &str) -> Result<HashMap<String, String>, String> {\n'
        '    let mut map = HashMap::new();\n'
        '    for (lineno, line) in input.lines().enumerate() {\n'
        '        let line = line.trim();\n'
        '        if line.is_empty() || line.starts_with(\'#\') {\n'
        '            continue;\n'
        '        }\n',
        '        map.insert(key.trim().to_string(), value.trim().to_string());\n'
        '    }\n'
        '    Ok(map)\n}\n',
    ),
    _case(
        "java", "binary_search", "//",
        'public final class Search {\n'
        '    private Search() {}\n\n'
        '    /** Returns the index of key in the sorted array, or -1. */\n'
        '    public static int binarySearch(int[] a, int key) {\n'
        '        int lo = 0;\n'
        '        int hi = a.length - 1;\n'
        '        while (lo <= hi) {\n'
        '            int mid = (lo + hi) >>> 1;\n',
        '        }\n'
        '        return -1;\n'
        '    }\n}\n',
    ),
    _case(
        "c", "list_reverse", "//",
        '#include <stddef.h>\n\n'
        'struct node {\n    int value;\n    struct node *next;\n};\n\n'
        '/* Reverse a singly linked list in place and return the new head. */\n'
        'struct node *list_reverse(struct node *head)\n{\n'
        '    struct node *prev = NULL;\n'
        '    while (head != NULL) {\n',
        '    }\n'
        '    return prev;\n}\n',
    ),
    _case(
        "cpp", "word_count", "//",
        '#include <map>\n#include <sstream>\n#include <string>\n\n'
        'std::map<std::string, int> word_count(const std::string& text) {\n'
        '    std::map<std::string, int> counts;\n'
        '    std::istringstream in(text);\n'
        '    std::string word;\n',
        '    return counts;\n}\n',
    ),
    _case(
        "javascript", "group_by", "//",
        '/**\n * Group items by the value returned from keyFn.\n'
        ' * @returns {Map<any, any[]>}\n */\n'
        'function groupBy(items, keyFn) {\n'
        '  const groups = new Map();\n'
        '  for (const item of items) {\n'
        '    const key = keyFn(item);\n',
        '  }\n'
        '  return groups;\n}\n\nmodule.exports = { groupBy };\n',
    ),
    _case(
        "sql", "monthly_revenue", "--",
        '-- Revenue per customer per month for paid orders.\n'
        'SELECT\n'
        '    c.id AS customer_id,\n'
        '    c.name,\n'
        "    date_trunc('month', o.created_at) AS month,\n",
        'FROM customers c\n'
        'JOIN orders o ON o.customer_id = c.id\n'
        "WHERE o.status = 'paid'\n"
        'GROUP BY c.id, c.name, month\n'
        'ORDER BY month, revenue DESC;\n',
    ),
    _case(
        "bash", "backup_rotate", "#",
        'set -euo pipefail\n\n'
        'BACKUP_DIR="${BACKUP_DIR:-/var/backups/app}"\n'
        'KEEP="${KEEP:-7}"\n\n'
        'mkdir -p "$BACKUP_DIR"\n'
        'stamp="$(date +%Y%m%d-%H%M%S)"\n'
        'tar -czf "$BACKUP_DIR/app-$stamp.tar.gz" /srv/app\n\n'
        '# delete all but the newest $KEEP archives\n',
        '\necho "backup $stamp done"\n',
    ),
)


def unique_line(case: FimCase, tag: str) -> str:
    """The first line of a prompt: a comment holding a per-request unique tag."""
    return f"{case.comment} {tag}\n"


def build_prompt(case: FimCase, tag: str, max_chars: int | None = None) -> str:
    """Return the FIM prompt for ``case`` with ``tag`` making its prefix unique.

    The unique comment line always comes first. If ``max_chars`` is set, prefix and
    suffix are trimmed so that the prefix text (including the unique line) plus the
    suffix text is at most ``max_chars`` characters; the FIM special tokens are not
    counted. The prefix keeps its *end* (the code next to the cursor), the suffix
    keeps its *start*; the prefix gets two thirds of the budget, and whatever one
    side does not need goes to the other.
    """
    head = unique_line(case, tag)
    prefix, suffix = case.prefix, case.suffix
    if max_chars is not None:
        budget = max(0, max_chars - len(head))
        want_p, want_s = len(prefix), len(suffix)
        if want_p + want_s > budget:
            p_share = (budget * 2) // 3
            s_share = budget - p_share
            if want_s < s_share:
                p_share = budget - want_s
            elif want_p < p_share:
                s_share = budget - want_p
            p_share = min(p_share, want_p)
            s_share = min(s_share, want_s)
            prefix = prefix[len(prefix) - p_share:] if p_share else ""
            suffix = suffix[:s_share]
    return fim_prompt(head + prefix, suffix)
