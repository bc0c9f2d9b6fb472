;;;; package.lisp -- the GALLOP.CORE package: the core's contract with its
;;;; front ends.
;;;;
;;;; The core knows nothing about Hunchentoot: it accepts connections, holds
;;;; them in epoll while they are idle or while a request head is still
;;;; arriving, and hands a worker from an elastic pool a connection whose
;;;; request head is complete.  The front ends (src/native/, src/clack/,
;;;; src/hunchentoot/, src/package.lisp) supply the function that serves a
;;;; request.
;;;;
;;;; The exports below are all a front end may name, grouped by the core
;;;; folder that defines them; every other symbol of the package is the
;;;; core's own, free to change.  tests/core/contract.lisp reads every
;;;; front-end file and fails when one names a core symbol not exported here,
;;;; and when an export here is named by no front end (bar its commented
;;;; allow-list).

(defpackage #:gallop.core
  (:use #:common-lisp)
  (:export
   ;; os/: the clock, octet scanning, TLS contexts and listening sockets
   ;; (bound here, or passed by a supervisor).
   #:unix-seconds #:listen-socket-fd
   #:octet-position #:octets-case #:+crlf-octets+
   #:make-tls-context #:free-tls-context
   #:open-listen-socket #:claim-activated-socket #:release-activated-socket
   #:socket-of-fd

   ;; pool/: work run on an engine's workers; a worker's own pool and its
   ;; thread-local values.
   #:pool-submit #:pool-thread-count #:*worker-pool* #:*worker-locals*

   ;; account: the limit of the process's memory account.
   #:set-memory-limit

   ;; engine, settings: an engine's pool, TLS and answer delay; its own
   ;; answers' octets and reason phrases; rate-limited, cut log lines; every
   ;; user setting, its default and a function taking them all.
   #:engine-running-p #:engine-pool #:engine-tls #:engine-retry-after
   #:error-body-bytes #:reason-phrase
   #:+backtraces-per-second+ #:backtrace-due-p #:timeout-line-due
   #:note-client-abort #:cut-log-line #:format-log-line #:+max-log-line+
   #:define-settings-function #:setting-arguments #:setting-default
   #:setting-slot-definitions #:+settings+

   ;; http/: a connection (a binary Gray stream): its ends, the record of its
   ;; request's head, its body, the output it writes and its errors.
   #:connection #:connection-engine
   #:connection-remote-address #:connection-remote-port
   #:connection-local-address #:connection-local-port
   #:connection-user-data #:connection-owner-stream #:connection-mark-boundary
   #:connection-tls-p #:make-plain-connection #:call-with-header-deadline
   #:connection-request #:connection-head #:connection-consume-head
   #:connection-close-after-p
   #:request-method #:request-minor #:request-target-start #:request-target-end
   #:request-query-start #:request-content-length #:request-expect-continue
   #:request-keep-alive #:do-request-fields
   #:connection-write-continue #:connection-body-pending-p
   #:connection-head-pending-p #:make-body-stream #:connection-give-body
   #:request-body-error #:request-body-error-status
   #:connection-detach #:connection-detached-p
   #:connection-write-octets #:connection-write-latin1 #:connection-write-ascii
   #:connection-write-decimal #:connection-reserve-output
   #:connection-commit-output #:put-latin1 #:put-decimal
   #:connection-flush #:connection-send-file
   #:make-shared-octets #:release-shared-octets
   #:connection-count-answer
   #:connection-error #:connection-timeout-error
   #:handler-timeout #:handler-timeout-seconds

   ;; timers/: a thunk run on a worker once its time comes.
   #:schedule-timer #:cancel-timer

   ;; loop/: a connection's turns on a worker (taken, given back, suspended
   ;; and resumed); connections adopted or shed; the overload manager's
   ;; refusal; connections that switched protocols, in epoll or under a
   ;; handler's thread.
   #:connection-take-head #:connection-acquire #:connection-release
   #:connection-suspend #:connection-unsuspend #:connection-resume
   #:stop-cut-message
   #:engine-adopt-fd #:engine-shed-fd #:engine-overloaded-p
   #:overloaded
   #:connection-upgrade #:connection-upgraded-p #:connection-send-upgraded
   #:connection-send-shared #:connection-close-upgraded #:connection-cut-upgraded
   #:connection-upgraded-pending #:connection-charge-upgraded
   #:connection-set-upgraded-idle-timeout #:connection-upgraded-idle-timeout
   #:connection-upgraded-silence
   #:connection-set-upgraded-on-shed #:connection-set-upgraded-on-limit
   #:connection-switch #:connection-switched-p #:connection-may-switch-p

   ;; server: an engine made, started, drained, stopped; its readiness and
   ;; its stats.
   #:make-engine #:engine-start #:engine-stop #:engine-drain #:engine-ready-p
   #:engine-stats

   ;; metrics: an engine's stats and answer counts in Prometheus' text
   ;; format, and that format's content type.
   #:engine-metrics #:+metrics-content-type+))
