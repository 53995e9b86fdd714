//! Create, delete, an operator's invalid `metadata.json`: one instance.

use super::*;

#[tokio::test]
async fn create_runs_the_sandbox_under_a_new_lease_and_a_second_with_its_id_is_refused() {
    use SandboxEvent::{LeaseAcquired, LeaseAcquiring, Running};
    let world = World::new();
    let a = world.instance("a");
    let (id, metadata) = world.new_sandbox(false);
    let mut events = a.controller.subscribe(&id);
    a.create_from(&metadata).await.unwrap();
    assert!(matches!(a.pass(&id).await, Requeue::After(_)));
    // Lease events go out whatever the handoff flag; the API layer filters.
    let expected = [LeaseAcquiring, LeaseAcquired, Running { epoch: 1 }];
    assert_eq!(drain(&mut events), expected);
    assert!(a.runs(&id));
    let status = world.metadata(&id).await.status;
    let ready = status.condition("Ready").cloned().unwrap();
    assert_eq!(ready.status, crate::api::ConditionStatus::True);
    assert_eq!(status.phase, Phase::Running);
    assert_eq!(status.holder, Some(named("a")));
    assert_eq!(status.epoch, 1);
    let lease = world.lease(&id).await;
    assert_eq!(lease.holder, Some(named("a")));
    assert!(lease.wanted_by.is_none(), "the fulfilled intent is cleared");
    assert_eq!(a.runtime.counts(), (1, 0));
    let refused = a.create_from(&metadata).await;
    assert!(matches!(refused, Err(ControlError::AlreadyExists(_))));
}

#[tokio::test]
async fn delete_destroys_tombstones_releases_and_purges_later() {
    use SandboxEvent::{Deleted, LeaseReleased, LeaseReleasing, Stopping};
    let (world, a, id) = World::with_a_sandbox().await;
    let mut events = a.controller.subscribe(&id);
    // The pass that serves the request deletes it.
    a.delete(&id).await;
    let expected = [Stopping, LeaseReleasing, LeaseReleased, Deleted];
    assert_eq!(drain(&mut events), expected);
    assert!(!a.runs(&id));
    assert_eq!(world.metadata(&id).await.status.phase, Phase::Deleted);
    assert_eq!(world.lease(&id).await.holder, None);
    // The tombstone stays for the retention, then everything goes.
    let retention = std::time::Duration::from_secs(600);
    assert_eq!(a.pass(&id).await, Requeue::After(retention));
    assert!(world.exists(metadata_key(&id)).await);
    world.clock.advance(Duration::seconds(601));
    assert_eq!(a.pass(&id).await, Requeue::Never);
    assert!(!world.exists(metadata_key(&id)).await);
    assert!(!world.exists(lock_key(&id)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_sandbox_takes_no_other_intent_and_never_comes_back() {
    let (world, a, id) = World::with_a_sandbox().await;
    let b = world.instance("b");
    a.delete(&id).await;
    let refused = |outcome: Result<(), ControlError>| {
        matches!(outcome, Err(ControlError::Deleted(_)))
            .then_some(())
            .ok_or(outcome)
    };
    // Before its holder acts, a checkpoint or attach elsewhere can't undo it.
    refused(b.request_state(&id, DesiredState::Checkpointed, None).await).unwrap();
    // An attach whose ring lands before its spec write is answered returns
    // at once; the refusal of that write then comes in the background.
    let attach = b.request_here(&id, None).await;
    let answered = matches!(attach, Ok(()) | Err(ControlError::Deleted(_)));
    assert!(answered, "{attach:?}");
    a.pass(&id).await;
    let tombstone = world.metadata(&id).await;
    assert_eq!(tombstone.status.phase, Phase::Deleted);
    assert_eq!(tombstone.spec.desired_state, DesiredState::Deleted);
    // The tombstone takes none either.
    refused(b.request_state(&id, DesiredState::Running, None).await).unwrap();
    // Set running by hand, then attached: that hold is released, nothing
    // starts; `sandboxctl delete` (desired `deleted`) lets the purge go on.
    world.set_desired(&id, DesiredState::Running).await;
    let _ = b.request_here(&id, None).await;
    for _ in 0..3 {
        b.pass(&id).await;
        a.pass(&id).await;
    }
    assert!(!b.runs(&id) && !a.runs(&id));
    assert_eq!(world.lease(&id).await.holder, None);
    world.clock.advance(Duration::seconds(601));
    a.pass(&id).await;
    assert!(world.exists(metadata_key(&id)).await);
    a.delete(&id).await;
    a.pass(&id).await;
    b.pass(&id).await;
    assert!(!world.exists(metadata_key(&id)).await);
    assert!(!b.runs(&id) && !a.runs(&id));
}

#[tokio::test]
async fn invalid_json_from_an_operator_is_reported_and_changes_nothing() {
    let (world, a, id) = World::with_a_sandbox().await;
    let oops = &b"{\"apiVersion\": \"sandboxd.dev/v1\", oops"[..];
    world.overwrite(&metadata_key(&id), oops).await;
    // Between full passes only the lease is looked after.
    assert!(a.reconcile(&id).await.is_ok());
    world.clock.advance(Duration::seconds(121));
    let err = a.reconcile(&id).await.unwrap_err();
    assert!(err.to_string().contains("metadata.json"), "{err}");
    assert!(a.runs(&id), "the sandbox keeps running");
    assert!(a.controller.is_held_here(&id));
}
