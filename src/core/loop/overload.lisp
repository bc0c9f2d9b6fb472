;;;; overload.lisp -- the overload manager: what the servers of a process do
;;;; as the memory account (account.lisp) fills, in a fixed order, so that
;;;; the server chooses whom to shed before the heap does.
;;;;
;;;;   level 1  The largest holders are not read from: an upgraded
;;;;            connection holding LARGE-HOLDER-OCTETS or more waits, unread,
;;;;            until the level is back to 0 (its client's TCP window fills
;;;;            and it stops sending); and request bodies go to temporary
;;;;            files instead of memory (spool.lisp).
;;;;   level 2  Also: new upgrades (WebSockets, and switching under a
;;;;            handler) and new bodies larger than BODY-BUFFER-BYTES, or
;;;;            chunked, get 503 with Retry-After before any of it is held.
;;;;   level 3  Also: the connections holding the most are closed, largest
;;;;            first, until the account is back under level 2's threshold.
;;;;            A WebSocket is closed as its layer says (the native one sends
;;;;            1013, try again later), a connection whose body is arriving
;;;;            gets 503, one whose answer waits for its client is reset.
;;;;
;;;; Fresh small requests are served at every level: they hold little, and
;;;; only for their turn.  One housekeeper at a time makes the manager's pass
;;;; (OVERLOAD-PASS, shed.lisp), over every running engine of the process, at
;;;; most every +OVERLOAD-PASS-MS+.  (doc/design.md, "One memory account".)

(in-package #:gallop.core)

(defconstant +overload-pass-ms+ 100
  "The least time between two passes of the overload manager.")

(defconstant +shed-floor-octets+ (* 16 1024)
  "Connections holding fewer octets than this are never shed: closing them
would give back too little to matter.")

(defun large-holder-octets ()
  "What a connection holds, at least, to count among the largest holders
that level 1 stops reading from: a thousandth of the account's limit, at
least 64 KiB."
  (max (* 64 1024) (floor (account-limit) 1024)))

;;; Counts of the manager's actions, process-wide (GALLOP:STATS, metrics).
(declaim (type (simple-array sb-ext:word (3)) *overload-counts*))
(sb-ext:defglobal *overload-counts* (make-array 3 :element-type 'sb-ext:word :initial-element 0)
  "Connections paused (level 1), requests refused (level 2) and connections
closed (level 3) by the overload manager, in all.")

(defun overload-counts ()
  "The overload manager's counts: (values PAUSED REFUSED SHED)."
  (values (aref *overload-counts* 0) (aref *overload-counts* 1) (aref *overload-counts* 2)))

(defun connection-held-octets (c)
  "Octets C holds for its client now, of the kinds the account counts (bar
thread stacks): its input buffer while charged as a partial head, its body
in memory, its unsent output, and once upgraded what its layer assembles
and what waits in its mailbox.  Read from any thread: approximate while
its owner works."
  (let ((spool (request-spool (connection-request c)))
        (u (conn-slot c upgrade)))
    (+ (conn-slot c budgeted)
       (if spool (spool-charged spool) 0)
       (max 0 (conn-slot c unsent-bytes))
       (if u (+ (upgrade-charged u) (upgrade-inflated u) (upgrade-mailbox-bytes u)) 0))))

;;; The engines of the process, which the manager's pass looks through.
(sb-ext:defglobal *engines* '())
(sb-ext:defglobal *engines-lock* (sb-thread:make-mutex :name "gallop engines"))

(defun register-engine (engine)
  (sb-thread:with-mutex (*engines-lock*)
    (pushnew engine *engines*)))

(defun unregister-engine (engine)
  (sb-thread:with-mutex (*engines-lock*)
    (setf *engines* (remove engine *engines*))))

;;; Level 1: upgraded connections not read from.

(sb-ext:defglobal *paused* '()
  "Upgraded connections left unread at level 1, to be handed to a worker
again once the level is back to 0.")

(defun pause-upgraded-p (c)
  "True when the upgraded connection C must not be read from now (level 1
or more, and C among the largest holders): then it is noted, to be served
again once the level falls to 0.  Its owner parks it without reading."
  (when (and (plusp (overload-level))
             (>= (connection-held-octets c) (large-holder-octets)))
    (unless (conn-slot c paused)
      (setf (conn-slot c paused) t)
      (sb-ext:atomic-incf (aref *overload-counts* 0))
      (sb-ext:atomic-push c *paused*))
    t))

(defun resume-paused ()
  "Hand every paused connection to a worker of its group again: as if its
client had sent, so that it reads what waits in its socket."
  (let ((paused (loop for old = *paused*
                      when (eq old (sb-ext:compare-and-swap (symbol-value '*paused*) old nil))
                        return old)))
    (dolist (c paused)
      (setf (conn-slot c paused) nil)
      (unless (eq (connection-state c) :closed)
        (group-requeue (connection-group c) (connection-token c))))))

;;; Level 2: refusals.

(defun note-overload-refusal ()
  (sb-ext:atomic-incf (aref *overload-counts* 1)))

(defun refuses-upgrades-p ()
  "True when new upgrades get 503 (level 2 or more): counted as a refusal."
  (when (>= (overload-level) 2)
    (note-overload-refusal)
    t))

(defun refuses-body-p (c)
  "True when the body C's request announces is refused now: level 2 or
more, and chunked or longer than the engine keeps in memory."
  (and (>= (overload-level) 2)
       (let ((request (connection-request c)))
         (or (request-chunked request)
             (> (request-body-left request) (engine-body-buffer-bytes (connection-engine c)))))
       (progn (note-overload-refusal) t)))

(define-condition overloaded (error)
  ()
  (:report "The server is short of memory: it takes no new upgrade now.")
  (:documentation "Signalled by CONNECTION-UPGRADE at overload level 2 or more:
the layer above answers 503 with Retry-After."))
