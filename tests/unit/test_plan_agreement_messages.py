"""The pure half of the plan agreement: digests and the first difference between two plans."""

from __future__ import annotations

from tensorplay.distributed._checks.plan_agreement import PlanEntry, first_difference, mismatch_message, plan_digest

A = PlanEntry("a.weight", (8, 4), "torch.float32", "unit 'a'")
B = PlanEntry("b.weight", (4, 4), "torch.float32", "unit 'b'")


def test_digest_is_deterministic_and_sensitive_to_every_field() -> None:
    assert plan_digest([A, B]) == plan_digest([PlanEntry(*A), PlanEntry(*B)])
    variants = [[B, A], [A], [A._replace(shape=(8, 5)), B], [A._replace(dtype="torch.float16"), B],
                [A._replace(detail="unit 'x'"), B], [A._replace(name="a.bias"), B]]
    digests = {tuple(plan_digest(v)) for v in variants} | {tuple(plan_digest([A, B]))}
    assert len(digests) == len(variants) + 1


def test_first_difference_names_the_field_and_both_ranks() -> None:
    wide = A._replace(shape=(8, 6))
    assert first_difference(0, [A, B], 1, [wide, B]) == "rank 1 has 'a.weight' of shape (8, 6), rank 0 (8, 4)"
    half = A._replace(dtype="torch.float16")
    assert first_difference(0, [A], 3, [half]) == \
        "rank 3 has 'a.weight' of dtype torch.float16, rank 0 torch.float32"
    moved = A._replace(detail="unit 'b'")
    assert first_difference(0, [A], 1, [moved]) == "rank 1 has 'a.weight' with unit 'b', rank 0 with unit 'a'"


def test_first_difference_missing_extra_and_order() -> None:
    assert first_difference(0, [A, B], 1, [A]).startswith("rank 1 has no 'b.weight', which rank 0 has")
    assert first_difference(0, [A], 2, [A, B]).startswith("rank 2 has an extra 'b.weight'")
    assert first_difference(0, [A, B], 1, [B]).startswith("rank 1 has no 'a.weight'")
    assert first_difference(0, [A], 1, [B, A]).startswith("rank 1 has an extra 'b.weight'")
    assert first_difference(0, [A, B], 1, [B, A]) == \
        "rank 1 lists 'b.weight' at position 0 where rank 0 lists 'a.weight' (a different order)"


def test_message_groups_the_ranks() -> None:
    wide = A._replace(shape=(8, 6))
    message = mismatch_message([[A], [A], [wide], [wide]], [0, 1, 2, 3], "fully_shard")
    assert message.startswith("fully_shard: the ranks' sharding plans differ")
    assert "rank 2 has 'a.weight' of shape (8, 6), rank 0 (8, 4)" in message
    assert "Ranks [0, 1] agree with rank 0; ranks [2, 3] differ" in message
