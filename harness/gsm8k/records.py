"""What one GSM8K evaluation leaves behind: per-question records and per-filter scores (JSON-ready)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

STRICT = "strict-match"
FLEXIBLE = "flexible-extract"
FILTERS: tuple[str, ...] = (STRICT, FLEXIBLE)
INVALID = "[invalid]"  # what lm-eval's regex filter returns when nothing matches


@dataclass(frozen=True)
class QuestionRecord:
    """One question as lm-eval scored it.

    `answers` and `correct` are keyed by lm-eval filter name (strict-match, flexible-extract).
    `target` is lm-eval's doc_to_target (the full reference solution for the plain task);
    `target_answer` is its final number (the text after '####' when present).
    `prompt_hash` is lm-eval's hash of the full prompt: equal hashes mean equal few-shot context.
    """

    index: int
    question: str
    target: str
    target_answer: str
    generation: str
    answers: Mapping[str, str]
    correct: Mapping[str, bool]
    prompt_hash: str = ""
    doc_hash: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "question": self.question, "target": self.target,
                "target_answer": self.target_answer, "generation": self.generation,
                "answers": dict(self.answers), "correct": dict(self.correct),
                "prompt_hash": self.prompt_hash, "doc_hash": self.doc_hash}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "QuestionRecord":
        return cls(index=int(data["index"]), question=data["question"], target=data["target"],
                   target_answer=data["target_answer"], generation=data["generation"],
                   answers=dict(data["answers"]), correct={k: bool(v) for k, v in data["correct"].items()},
                   prompt_hash=data.get("prompt_hash", ""), doc_hash=data.get("doc_hash", ""))


def final_answer(target: str) -> str:
    """The final number of a GSM8K solution ('... #### 18' -> '18'); other targets unchanged."""
    return target.split("####")[-1].strip()


@dataclass(frozen=True)
class GSM8KResult:
    """One lm-eval GSM8K run: scores and stderrs per filter (0..1), and the per-question records."""

    task: str
    num_fewshot: int
    n: int
    scores: Mapping[str, float]
    stderrs: Mapping[str, float]
    records: tuple[QuestionRecord, ...] = field(default_factory=tuple)
    wall_s: float = 0.0
    batch: int = 0  # sequences generated at once (the engine's KV pool may hold fewer than asked); 0: unknown

    def score(self, filter_name: str = STRICT) -> float:
        return self.scores[filter_name]

    def summary(self, filter_name: str = STRICT) -> dict[str, Any]:
        """The cell's details["gsm8k"] head: task, filter, n, score, stderr (what baselines read)."""
        return {"task": self.task, "filter": filter_name, "num_fewshot": self.num_fewshot, "n": self.n,
                "score": self.scores[filter_name], "stderr": self.stderrs.get(filter_name, 0.0),
                "scores": dict(self.scores), "stderrs": dict(self.stderrs)}

    def to_dict(self) -> dict[str, Any]:
        return {"task": self.task, "num_fewshot": self.num_fewshot, "n": self.n, "scores": dict(self.scores),
                "stderrs": dict(self.stderrs), "wall_s": self.wall_s, "batch": self.batch,
                "records": [r.to_dict() for r in self.records]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GSM8KResult":
        return cls(task=data["task"], num_fewshot=int(data["num_fewshot"]), n=int(data["n"]),
                   scores={k: float(v) for k, v in data["scores"].items()},
                   stderrs={k: float(v) for k, v in data["stderrs"].items()},
                   records=tuple(QuestionRecord.from_dict(r) for r in data.get("records", [])),
                   wall_s=float(data.get("wall_s", 0.0)), batch=int(data.get("batch", 0)))
