//! Forks: a new sandbox restored from its own copy of another's checkpoint.

use super::*;

/// A fork restores its own copy of the source's checkpoint (same memory, own
/// objects), leaves the source untouched, and outlives the source's image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_restores_its_own_copy_of_the_sources_checkpoint() {
    use super::reconciler::ForkPoint;
    let world = World::new();
    let (a, source) = world.a_running("x=1").await;
    a.checkpoint(&source, Some("first")).await;
    let source_doc = world.metadata(&source).await;
    let source_ref = source_doc.status.latest_checkpoint.clone().unwrap();

    let b = world.instance("b");
    let mut forks = Vec::new();
    for _ in 0..3 {
        let (fork, metadata) = world.new_sandbox(true);
        let forked = b.fork_from(&source_doc, &ForkPoint::Latest, metadata);
        forked.await.unwrap();
        b.pass(&fork).await;
        assert_eq!(b.runtime.memory(&fork).unwrap(), vec!["x=1".to_owned()]);
        let status = world.metadata(&fork).await.status;
        assert_eq!(status.phase, Phase::Running);
        let own = status.latest_checkpoint.unwrap();
        assert_ne!(own.path, source_ref.path, "a fork never shares an image");
        assert_eq!(own.sha256, source_ref.sha256);
        assert_eq!(status.forked_from.unwrap().sandbox_id, source);
        forks.push(fork);
    }
    // Each diverges on its own.
    b.run(&forks[0], "y=2").await;
    assert_eq!(b.runtime.memory(&forks[0]).unwrap().len(), 2);
    assert_eq!(b.runtime.memory(&forks[1]).unwrap(), vec!["x=1".to_owned()]);
    // The source is as it was: checkpointed, nobody holds it.
    assert_eq!(world.metadata(&source).await.status, source_doc.status);
    assert_eq!(world.lease(&source).await.holder, None);

    // The source's retention may delete its checkpoint: each fork has a copy.
    let source_id = crate::layout::checkpoint_id_of_image(&source_ref.path).unwrap();
    let source_image = checkpoint_image_key(&source_id);
    world.store.delete(&source_image).await.unwrap();
    for fork in &forks {
        let own = world.metadata(fork).await.status.latest_checkpoint.unwrap();
        let image = ObjectKey::new(own.path.as_str()).unwrap();
        assert_eq!(world.store.get(&image).await.unwrap().data.as_ref(), b"x=1");
    }
    // A gone checkpoint, an unknown name, or none: fails, recording nothing.
    let fresh = a.create(&world).await;
    let fresh_doc = world.metadata(&fresh).await;
    let nope = ForkPoint::Named("nope".into());
    for (from, point, why) in [
        (&source_doc, ForkPoint::Latest, "cannot copy the checkpoint"),
        (&source_doc, nope, "no checkpoint named \"nope\""),
        (&fresh_doc, ForkPoint::Latest, "has no checkpoint yet"),
    ] {
        let (fork, metadata) = world.new_sandbox(false);
        let err = b.fork_from(from, &point, metadata).await.unwrap_err();
        assert!(err.to_string().contains(why), "{err}");
        let recorded = world.exists(metadata_key(&fork)).await;
        assert!(!recorded, "{why}: the fork was recorded");
    }
}

/// A client told CHECKPOINTED may fork it at once elsewhere, before its record
/// lands: from the lock's checkpoint (decision 18), latest or by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_starts_from_a_checkpoint_whose_record_has_not_landed() {
    use super::reconciler::ForkPoint;
    // New writes pass (the fork's own); the record still waits.
    let (world, gated, a, source) =
        super::checkpoints::checkpointed_before_its_record(Some("base")).await;
    let b = world.instance("b");
    let read = b.controller.read_with_carried(&source).await;
    let source_doc = read.unwrap().unwrap();
    for point in [ForkPoint::Latest, ForkPoint::Named("base".into())] {
        let (fork, metadata) = world.new_sandbox(false);
        let forked = b.fork_from(&source_doc, &point, metadata).await;
        forked.unwrap_or_else(|err| panic!("{point:?}: {err}"));
        b.pass(&fork).await;
        assert_eq!(b.runtime.memory(&fork).unwrap(), vec!["x=1".to_owned()]);
    }
    gated.hook.gate.add_permits(1000);
    a.reconciler().background_settled().await;
}
