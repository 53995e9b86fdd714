//! The gVisor runtime's warm pool as admission sizes it: the adapter from
//! [`GvisorRuntime`] to the API layer's [`WarmPoolControl`]. It lives here,
//! in the composition root, the one place that knows both the runtime and
//! the API layer, so neither has to know the other.

use controllers::runtime::WarmPoolStats;

use crate::api::admission::WarmPoolControl;
use crate::runtime::GvisorRuntime;

impl WarmPoolControl for GvisorRuntime {
    fn stats(&self) -> WarmPoolStats {
        self.warm_pool()
    }

    fn resize(&self, size: usize) {
        self.resize_warm_pool(size);
    }
}
