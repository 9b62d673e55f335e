"""The task a page's method runs on: the model's own, one of the built-in tasks, or the user's own problems
(an uploaded JSONL file: one `question` and numeric `answer` a line, checked line by line and kept under its
digest by `analyses.tasks.store_problem_file`, so a run keyed by it never reads another file's problems)."""

from __future__ import annotations

from typing import Any

from analyses.tasks import TASK_NAMES, is_task_file, store_problem_file, task_size

OWN_PROBLEMS = "your own problems (.jsonl)"


def task_picker(container: Any, label: str, own: str, key: str) -> str:
    """A task select box in `container` (the model's own task first) with a last choice that uploads a problem
    file; returns the task name a run uses. Until a valid file is uploaded the model's own task stands, and
    the page says so (a malformed file: which line is wrong)."""
    choice = container.selectbox(label, [own, *(t for t in TASK_NAMES if t != own), OWN_PROBLEMS], key=key)
    if choice != OWN_PROBLEMS:
        return choice
    upload = container.file_uploader('Problems: one JSON object a line, {"question": ..., "answer": <a number>} '
                              '(GSM8K\'s "... #### 18" answers are read)', type=["jsonl"], key=f"{key}_file")
    if upload is None:
        container.info(f"Upload a problem file; until then the task is **{own}**.", icon=":material/upload_file:")
        return own
    from thoughtscope.errors import BadInputError

    try:
        task = store_problem_file(upload.getvalue(), upload.name)
    except BadInputError as err:
        container.error(f"{upload.name}: {err} The task stays **{own}**.", icon=":material/error:")
        return own
    container.caption(f"Problems from `{upload.name}` (kept as `{task}`).")
    return task


def at_most_held(container: Any, task: str, n: int, what: str = "the harvest") -> int:
    """`n` problems, or all a problem file holds when it holds fewer, said under the widget (64 asked of a
    60-problem file once failed only after the press); `what` names the work that takes them."""
    size = task_size(task) if is_task_file(task) else None
    if size is None or n <= size:
        return n
    container.caption(f"The file holds {size} problems: {what} takes all of them.")
    return size
