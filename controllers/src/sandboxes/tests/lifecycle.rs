//! Create, delete (tombstone, purge), a sandbox that died, and an operator's
//! invalid `metadata.json`: one instance, no handoff.

use super::*;

#[tokio::test]
async fn create_runs_the_sandbox_under_a_new_lease() {
    let world = World::new();
    let a = world.instance("a");
    let id = SandboxId::random();
    let mut events = a.controller.subscribe(&id);
    let metadata = SandboxMetadata::new(id.clone(), world.clock.now(), TOKEN_HASH.into());
    a.controller.create(&metadata).await.unwrap();
    let requeue = a.reconcile(&id).await.unwrap();

    assert!(matches!(requeue, Requeue::After(_)));
    // Lease events are published whatever the sandbox's handoff flag: the
    // API layer decides which of them a client sees.
    assert_eq!(
        drain(&mut events),
        vec![
            SandboxEvent::LeaseAcquiring,
            SandboxEvent::LeaseAcquired,
            SandboxEvent::Running { epoch: 1 }
        ]
    );
    assert!(a.runtime.memory(&id).is_some());
    let status = world.metadata(&id).await.status;
    assert_eq!(status.phase, Phase::Running);
    assert_eq!(status.holder.unwrap().as_str(), "a");
    assert_eq!(status.epoch, 1);
    let ready = world
        .metadata(&id)
        .await
        .status
        .condition("Ready")
        .cloned()
        .unwrap();
    assert_eq!(ready.status, crate::api::ConditionStatus::True);
    let lease = world.lease(&id).await;
    assert_eq!(lease.holder.unwrap().as_str(), "a");
    assert!(lease.wanted_by.is_none(), "the fulfilled intent is cleared");
    assert_eq!(a.runtime.counts(), (1, 0));
}

#[tokio::test]
async fn a_second_create_with_the_same_id_is_refused() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    let again = SandboxMetadata::new(id.clone(), world.clock.now(), TOKEN_HASH.into());
    assert!(matches!(
        a.controller.create(&again).await,
        Err(ControlError::AlreadyExists(_))
    ));
}

#[tokio::test]
async fn delete_destroys_tombstones_releases_and_purges_later() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    let mut events = a.controller.subscribe(&id);
    a.controller
        .request_state(&id, DesiredState::Deleted, None)
        .await
        .unwrap();
    let retention = std::time::Duration::from_secs(600);
    assert_eq!(a.reconcile(&id).await.unwrap(), Requeue::After(retention));
    assert_eq!(
        drain(&mut events),
        vec![
            SandboxEvent::Stopping,
            SandboxEvent::LeaseReleasing,
            SandboxEvent::LeaseReleased,
            SandboxEvent::Deleted
        ]
    );
    assert!(a.runtime.memory(&id).is_none());
    assert_eq!(world.metadata(&id).await.status.phase, Phase::Deleted);
    assert_eq!(world.lease(&id).await.holder, None);
    // The tombstone stays for the retention, then everything goes.
    assert!(matches!(a.reconcile(&id).await.unwrap(), Requeue::After(_)));
    assert!(world.store.get(&metadata_key(&id)).await.is_ok());
    world.clock.advance(Duration::seconds(601));
    assert_eq!(a.reconcile(&id).await.unwrap(), Requeue::Never);
    assert!(world.store.get(&metadata_key(&id)).await.is_err());
    assert!(world.store.get(&lock_key(&id)).await.is_err());
}

#[tokio::test]
async fn invalid_json_from_an_operator_is_reported_and_changes_nothing() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    world
        .store
        .put(
            &metadata_key(&id),
            Bytes::from_static(b"{\"apiVersion\": \"sandboxd.dev/v1\", oops"),
            PutMode::Overwrite,
        )
        .await
        .unwrap();
    // Between full passes only the lease is looked after.
    assert!(a.reconcile(&id).await.is_ok());
    world.clock.advance(Duration::seconds(121));
    let err = a.reconcile(&id).await.unwrap_err();
    assert!(err.to_string().contains("metadata.json"), "{err}");
    assert!(a.runtime.memory(&id).is_some(), "the sandbox keeps running");
    assert!(a.controller.is_held_here(&id));
}

#[tokio::test]
async fn a_sandbox_that_died_is_marked_failed_and_released() {
    let world = World::new();
    let a = world.instance("a");
    let id = a.create(&world).await;
    a.runtime.crash(&id);
    let mut events = a.controller.subscribe(&id);
    a.reconcile(&id).await.unwrap();
    assert_eq!(drain(&mut events), [SandboxEvent::Lost(LossCause::Died)]);
    let metadata = world.metadata(&id).await;
    assert_eq!(metadata.status.phase, Phase::Failed);
    assert_eq!(world.lease(&id).await.holder, None);
}
