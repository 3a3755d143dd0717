from __future__ import annotations

import json
import math

import pytest

from rollhub.curriculum import Curriculum, CurriculumConfig, CurriculumError, LessonConfig, LessonDependency


def lesson(lesson_id: str, *deps: LessonDependency, graduate: float = 0.9) -> LessonConfig:
    return LessonConfig(lesson_id, "mock", dependencies=deps, graduate_threshold=graduate)


def make(*lessons: LessonConfig, **kw) -> Curriculum:
    return Curriculum(CurriculumConfig(lessons=lessons, **kw))


def test_dependencies_must_form_a_dag() -> None:
    with pytest.raises(CurriculumError, match="cycle a -> b -> c -> a"):
        make(
            lesson("a", LessonDependency("b")),
            lesson("b", LessonDependency("c")),
            lesson("c", LessonDependency("a")),
        )
    with pytest.raises(CurriculumError, match="cycle"):
        make(lesson("a", LessonDependency("a")))
    with pytest.raises(CurriculumError, match="unknown lesson 'zz'"):
        make(lesson("a", LessonDependency("zz")))
    with pytest.raises(CurriculumError, match="more than once"):
        make(lesson("a"), lesson("a"))
    make(
        lesson("a"),
        lesson("b", LessonDependency("a")),
        lesson("c", LessonDependency("a"), LessonDependency("b")),
    )


def test_smoothed_success_is_an_ema() -> None:
    c = make(lesson("a"), smoothing=0.25)
    c.update_lesson_stats("a", 0.4, 8, "training", 1)
    assert c.stats["a"].smoothed_success == pytest.approx(0.4)
    c.update_lesson_stats("a", 0.8, 8, "training", 2)
    assert c.stats["a"].smoothed_success == pytest.approx(0.75 * 0.4 + 0.25 * 0.8)
    assert c.stats["a"].n_samples == 16


def test_weights_peak_at_half_success_with_bonus_and_floor() -> None:
    c = make(
        lesson("low"),
        lesson("mid"),
        lesson("high"),
        lesson("done"),
        smoothing=1.0,
        exploration_bonus=0.0,
        min_weight=0.05,
    )
    for lesson_id, s in [("low", 0.1), ("mid", 0.5), ("high", 0.9), ("done", 1.0)]:
        c.update_lesson_stats(lesson_id, s, 1000, "training", 1)
    w = c.sampling_weights()
    assert w["mid"] > w["low"] > w["done"] > 0 and w["low"] == pytest.approx(w["high"])
    raw_done = 0.05  # 4 * 1 * 0 = 0, floored
    assert w["done"] / w["mid"] == pytest.approx(raw_done / 1.0)


def test_exploration_bonus_favours_little_seen_lessons() -> None:
    c = make(lesson("seen"), lesson("new"), smoothing=1.0, exploration_bonus=0.5, min_weight=0.0)
    c.update_lesson_stats("seen", 0.0, 99, "training", 1)
    c.update_lesson_stats("new", 0.0, 3, "training", 1)
    w = c.sampling_weights()
    assert w["new"] / w["seen"] == pytest.approx((0.5 / math.sqrt(4)) / (0.5 / math.sqrt(100)))


def test_sample_lesson_follows_weights_and_is_seeded() -> None:
    c = make(lesson("a"), lesson("b"), smoothing=1.0, exploration_bonus=0.0, min_weight=0.01)
    c.update_lesson_stats("a", 0.5, 10, "training", 1)
    c.update_lesson_stats("b", 1.0, 10, "training", 1)
    draws = [c.sample_lesson(seed) for seed in range(2000)]
    share_b = draws.count("b") / len(draws)
    assert share_b == pytest.approx(0.01 / 1.01, abs=0.01)
    assert [c.sample_lesson(s) for s in range(50)] == draws[:50]


def test_locked_lessons_are_not_sampled_until_threshold() -> None:
    c = make(lesson("a"), lesson("b", LessonDependency("a", threshold=0.6, unlock_on_plateau=False)), smoothing=1.0)
    assert not c.is_unlocked("b") and set(c.sampling_weights()) == {"a"}
    c.update_lesson_stats("a", 0.5, 8, "training", 3)
    assert not c.is_unlocked("b")
    c.update_lesson_stats("a", 0.6, 8, "training", 4)
    assert c.is_unlocked("b") and c.stats["b"].unlocked_step == 4
    assert set(c.sampling_weights()) == {"a", "b"}


def test_plateau_unlocks_a_dependant() -> None:
    c = make(
        lesson("a"),
        lesson("b", LessonDependency("a", threshold=0.99)),
        plateau_window=4,
        plateau_tolerance=0.05,
    )
    for step, s in enumerate([0.1, 0.3, 0.31, 0.33]):
        c.update_lesson_stats("a", s, 8, "training", step)
    assert not c.is_unlocked("b")  # window 0.1..0.33 still rising
    c.update_lesson_stats("a", 0.32, 8, "training", 5)
    assert c.is_plateaued("a") and c.is_unlocked("b")


def test_plateau_does_not_unlock_when_disallowed() -> None:
    c = make(lesson("a"), lesson("b", LessonDependency("a", 0.99, unlock_on_plateau=False)), plateau_window=2)
    for step in range(5):
        c.update_lesson_stats("a", 0.3, 8, "training", step)
    assert c.is_plateaued("a") and not c.is_unlocked("b")


def test_chains_unlock_in_one_update() -> None:
    c = make(
        lesson("a"),
        lesson("b", LessonDependency("a", 0.5)),
        lesson("c", LessonDependency("b", 0.0)),
        smoothing=1.0,
    )
    c.update_lesson_stats("a", 0.7, 8, "training", 2)
    assert c.is_unlocked("b") and c.is_unlocked("c")


def test_graduation_is_judged_on_eval_only() -> None:
    c = make(lesson("a", graduate=0.9), lesson("b"), smoothing=1.0)
    c.update_lesson_stats("a", 1.0, 8, "training", 1)
    assert not c.is_graduated("a")
    c.update_lesson_stats("a", 0.85, 8, "eval", 2)
    assert not c.is_graduated("a") and c.stats["a"].eval_success == 0.85
    c.update_lesson_stats("a", 0.95, 8, "eval", 3)
    assert c.is_graduated("a") and c.stats["a"].graduated_step == 3
    assert c.active_lessons == ["b"] and set(c.sampling_weights()) == {"b"}
    assert not c.finished
    c.update_lesson_stats("b", 0.95, 8, "eval", 4)
    assert c.finished and set(c.sampling_weights()) == {"a", "b"}  # keeps serving at the floor


def test_graduation_of_a_dependency_unlocks() -> None:
    c = make(lesson("a", graduate=0.5), lesson("b", LessonDependency("a", 0.99, unlock_on_plateau=False)))
    c.update_lesson_stats("a", 0.6, 8, "eval", 1)
    assert c.is_unlocked("b")


def test_bad_updates_are_refused() -> None:
    c = make(lesson("a"))
    with pytest.raises(CurriculumError, match="unknown lesson 'x'"):
        c.update_lesson_stats("x", 0.5, 1, "training", 0)
    with pytest.raises(CurriculumError, match="must be in"):
        c.update_lesson_stats("a", 1.5, 1, "training", 0)
    with pytest.raises(CurriculumError, match="mode"):
        c.update_lesson_stats("a", 0.5, 1, "bogus", 0)  # type: ignore[arg-type]


def test_state_dict_round_trip_through_json() -> None:
    cfg = CurriculumConfig(lessons=(lesson("a"), lesson("b", LessonDependency("a", 0.3))), plateau_window=3)
    c = Curriculum(cfg)
    for step, s in enumerate([0.1, 0.4, 0.2, 0.5]):
        c.update_lesson_stats("a", s, 8, "training", step)
    c.update_lesson_stats("b", 0.7, 4, "eval", 9)
    restored = Curriculum(cfg)
    restored.load_state_dict(json.loads(json.dumps(c.state_dict())))
    assert restored.state_dict() == c.state_dict()
    assert restored.sampling_weights() == c.sampling_weights()
    assert [restored.sample_lesson(s) for s in range(20)] == [c.sample_lesson(s) for s in range(20)]
    other = make(lesson("z"))
    with pytest.raises(CurriculumError, match="same config"):
        other.load_state_dict(c.state_dict())


@pytest.mark.ray
def test_curriculum_runs_as_a_ray_actor() -> None:
    ray = pytest.importorskip("ray")
    from rollhub.curriculum.actor import RemoteCurriculum, get_or_create_curriculum_actor

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cfg = CurriculumConfig(lessons=(lesson("a"), lesson("b", LessonDependency("a", 0.5))), smoothing=1.0)
        handle = get_or_create_curriculum_actor(cfg, name="rollhub-curriculum-test")
        assert get_or_create_curriculum_actor(cfg, name="rollhub-curriculum-test")._actor_id == handle._actor_id
        remote = RemoteCurriculum(handle, cfg)
        assert remote.sample_lesson(0) == "a"
        remote.update_lesson_stats("a", 0.8, 8, "training", 1)
        state = remote.state_dict()  # ordered after the update on the same actor
        assert state["lessons"]["b"]["unlocked_step"] == 1
        local = Curriculum(cfg)
        local.load_state_dict(state)
        assert remote.metrics() == local.metrics()
        ray.kill(handle)
    finally:
        if started:
            ray.shutdown()
