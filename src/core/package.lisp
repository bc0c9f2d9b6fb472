;;;; package.lisp -- the GALLOP.CORE package.
;;;;
;;;; The core knows nothing about Hunchentoot: it accepts connections, holds
;;;; them in epoll while they are idle or while a request head is still
;;;; arriving, and hands a worker from an elastic pool a connection whose
;;;; request head is complete.  Layers above it (the Hunchentoot adapter, later
;;;; the native app API) supply the function that serves a request.

(defpackage #:gallop.core
  (:use #:common-lisp)
  (:export
   ;; pool
   #:pool #:make-pool #:pool-start #:pool-stop #:pool-submit
   #:pool-thread-count #:pool-idle-count #:pool-threads
   #:pool-standby-threads #:pool-max-threads
   ;; connections (a binary Gray stream)
   #:connection #:connection-fd #:connection-engine
   #:connection-remote-address #:connection-remote-port
   #:connection-local-address #:connection-local-port
   #:connection-user-data #:connection-mark-boundary
   #:connection-owner-stream #:make-plain-connection #:call-with-header-deadline
   #:connection-head #:connection-consume-head #:connection-close-after-p
   ;; the record of a request's head (request.lisp)
   #:request #:connection-request #:request-start #:request-end #:request-method
   #:request-minor #:request-target-start #:request-target-end #:request-query-start
   #:request-field-count #:request-field #:do-request-fields
   #:request-host-start #:request-host-end #:request-content-length #:request-chunked
   #:request-expect-continue #:request-keep-alive #:parse-head #:make-request
   #:connection-take-head #:connection-write-continue
   #:connection-read-body #:connection-body-pending-p #:connection-head-pending-p #:connection-detach #:connection-detached-p
   #:make-body-stream #:body-stream
   #:connection-write-octets #:connection-write-latin1 #:connection-write-ascii
   #:connection-write-decimal #:connection-reserve-output #:connection-commit-output
   #:put-latin1 #:put-decimal
   #:connection-flush #:connection-send-file
   #:connection-suspend #:connection-unsuspend
   #:connection-resume #:connection-error
   #:connection-timeout-error #:connection-shed-error #:handler-timeout #:handler-timeout-seconds
   #:stop-cut-message #:error-body-bytes
   #:request-body-error #:request-body-error-status
   #:chunk-decoder #:make-chunk-decoder #:reset-chunk-decoder #:chunk-decoder-step
   #:chunk-decoder-take #:chunk-decoder-state #:chunk-decoder-left
   #:+default-max-head-bytes+ #:+default-max-request-line-bytes+ #:+default-max-body-bytes+
   #:+default-max-unsent-bytes+ #:connection-acquire #:connection-release
   #:connection-unsent-bytes #:connection-give-body
   ;; connections that switched protocols (upgrade.lisp)
   #:connection-upgrade #:connection-upgraded-p #:connection-send-upgraded
   #:connection-close-upgraded #:connection-upgraded-pending
   #:connection-set-upgraded-idle-timeout #:connection-charge-upgraded
   #:connection-upgraded-idle-timeout #:connection-upgraded-silence
   #:connection-set-upgraded-on-shed
   #:connection-send-shared #:make-shared-octets #:release-shared-octets
   #:connection-set-upgraded-on-limit #:connection-cut-upgraded
   ;; the memory account (account.lisp) and the overload manager (overload.lisp)
   #:account-charge #:account-add #:account-used #:account-limit #:set-memory-limit
   #:overload-level #:overloaded
   #:connection-switch #:connection-switched-p #:connection-may-switch-p #:pool-step-out
   ;; engine
   #:engine #:make-engine #:engine-start #:engine-stop #:engine-drain #:engine-ready-p
   ;; TLS on the event loop (openssl.lisp)
   #:make-tls-context #:free-tls-context #:tls-context #:engine-tls #:connection-tls-p
   ;; application timers (timers.lisp)
   #:schedule-timer #:cancel-timer #:timer #:*worker-pool* #:*worker-locals*
   ;; settings (settings.lisp)
   #:+settings+ #:define-settings-function #:setting-arguments #:setting-slot-definitions
   #:setting-default
   #:engine-adopt-fd #:engine-shed-fd #:engine-overloaded-p
   #:engine-running-p #:engine-pool #:engine-stats
   ;; metrics (metrics.lisp): counted per answer, written in Prometheus' format
   #:connection-count-answer #:engine-metrics #:+metrics-content-type+
   #:reason-phrase #:+response-100+
   #:engine-listen-fd #:engine-max-body-bytes #:log-engine-error #:note-client-abort
   #:timeout-line-due #:backtrace-due-p #:+backtraces-per-second+ #:+max-log-line+ #:cut-log-line
   #:format-log-line
   ;; utilities used by the layers above
   #:octet-position #:octets-case #:octets-match-p #:unix-seconds
   #:+crlf-octets+
   #:set-nonblocking #:raise-fd-limit #:fd-limit
   #:listen-socket-fd #:open-listen-socket #:claim-activated-socket
   #:release-activated-socket #:socket-of-fd))
