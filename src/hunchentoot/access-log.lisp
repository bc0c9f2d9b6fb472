;;;; access-log.lisp -- the access log of Hunchentoot acceptors on Gallop.
;;;;
;;;; Hunchentoot writes a line per answer it makes (ACCEPTOR-LOG-ACCESS, to
;;;; ACCEPTOR-ACCESS-LOG-DESTINATION), its fields as the client sent them: a
;;;; quote in a User-Agent ends the field and forges the next.  GALLOP:ACCEPTOR
;;;; writes nginx's combined format instead, escaped as nginx escapes it
;;;; (:ACCESS-LOG-FORMAT :COMBINED, the default; the line is made by the
;;;; native access log's FILL-LOG-LINE), or Hunchentoot's own lines
;;;; (:HUNCHENTOOT).  Either way to the same destination, the same way:
;;;; under Hunchentoot's access-log lock, a file opened for each line.
;;;;
;;;; The answers the engine writes itself (400, 408, 413, 414, 431, 501,
;;;; 505, 503) never reach Hunchentoot: GALLOP:TASKMASTER gives the engine
;;;; LOG-ANSWER-LINE, which makes a line for each, on any acceptor it
;;;; serves, in the acceptor's format (for :HUNCHENTOOT, and a stock
;;;; acceptor, Hunchentoot's layout with the request line as received,
;;;; escaped).  It runs in the thread that wrote the answer, a worker or the
;;;; housekeeper, neither of which may wait on a disk or on Hunchentoot's
;;;; lock: the line goes on the taskmaster's ANSWER-LOG (a compare-and-swap)
;;;; and one writer at a time, handed to the pool, writes what it holds in
;;;; batches, one open of the file each (a storm of bad requests costs an
;;;; open a batch, not a line).  The log holds at most
;;;; *ANSWER-LOG-MAX-LINES* lines and *ANSWER-LOG-MAX-OCTETS* octets, each
;;;; line kept at its length: a line past them is dropped before it is
;;;; made, and counted (GALLOP:STATS :ACCESS-LOG-DROPPED).  Every line is
;;;; written or counted: lines the pool never wrote are written by the
;;;; taskmaster's stop (doc/design.md, "The engine's own answers are logged
;;;; through the layer above").

(in-package #:gallop)

(defmethod hunchentoot:acceptor-log-access ((acceptor acceptor) &key return-code)
  (if (eq (acceptor-access-log-format acceptor) :hunchentoot)
      (call-next-method)
      (let ((destination (hunchentoot:acceptor-access-log-destination acceptor)))
        (when destination
          (multiple-value-bind (line length) (combined-line return-code)
            (write-access-line destination line length))))))

(defun combined-line (status)
  "The combined-format line (octets, and its length) of the answer STATUS
to HUNCHENTOOT:*REQUEST*.  Its bytes are the body's Content-Length (0 for
HEAD, 1xx, 204 and 304; \"-\" when not known, a streamed body)."
  (let* ((request hunchentoot:*request*)
         (method (hunchentoot:request-method request))
         (length (hunchentoot:content-length*))
         (status (if (typep status '(integer 0 999)) status 500))
         (bytes (cond ((or (eq method :head) (< status 200) (= status 204) (= status 304)) 0)
                      ((typep length '(integer 0 #.most-positive-fixnum)) length)))
         (address (or (hunchentoot:remote-addr request) "-"))
         (authorization (hunchentoot:header-in :authorization request))
         (user (and (stringp authorization) (basic-auth-user authorization)))
         (uri (hunchentoot:request-uri request))
         (protocol (hunchentoot:server-protocol request))
         (referer (hunchentoot:header-in :referer request))
         (agent (hunchentoot:header-in :user-agent request)))
    (fill-log-line (make-array (log-line-size address user method uri protocol referer agent)
                               :element-type '(unsigned-byte 8))
                   :combined address user method uri protocol status bytes referer agent)))

(defun write-access-line (destination line length)
  "Append LINE[0,LENGTH) (ASCII octets) to DESTINATION, an access-log
destination, as Hunchentoot writes its lines (WRITE-ACCESS-LINES)."
  (let ((lines (list (cons line length))))
    (declare (dynamic-extent lines))
    (write-access-lines destination lines)))

(defun write-access-lines (destination lines)
  "Append LINES, (OCTETS . LENGTH) entries (ASCII), to DESTINATION, an
access-log destination, as Hunchentoot writes its lines: under its lock, a
pathname opened for the lines (a file logrotate moved is left at once), a
stream written and finished."
  (bt:with-lock-held ((hunchentoot-access-log-lock))
    (etypecase destination
      ((or string pathname)
       (with-open-file (out destination :direction :output :element-type '(unsigned-byte 8)
                                        :if-exists :append :if-does-not-exist :create)
         (loop for (line . length) in lines
               do (write-sequence line out :end length))))
      (stream
       (let ((text (subtypep (stream-element-type destination) 'character)))
         (loop for (line . length) in lines
               do (if text
                      (write-string (map 'string #'code-char (subseq line 0 length)) destination)
                      (write-sequence line destination :end length))))
       (finish-output destination)))))

;;; The engine's own answers

(defvar *answer-log-max-lines* 1024
  "Lines of the engine's own answers a taskmaster holds, made and not yet
written; past them a line is dropped (counted) before it is made.  Read
when the taskmaster starts.")

(defvar *answer-log-max-octets* (* 4 1024 1024)
  "Octets those lines may hold; past them a line is dropped (counted) before
it is made (its size then counted at its longest).  Read when the
taskmaster starts.")

(defstruct (answer-log (:constructor make-answer-log (acceptor submit)) (:copier nil))
  "The lines of the engine's own answers for ACCEPTOR, waiting for their
writer.  WAITING and OCTETS count the lines reserved and not yet written or
dropped, and their octets (a line in the making at its longest, then at its
length); WRITING is true while a writer is handed to the pool or runs, so
that one at most does."
  (acceptor nil :read-only t)
  (submit nil :type function :read-only t) ; (SUBMIT THUNK): THUNK to a worker
  (lines '())                               ; (OCTETS . LENGTH), newest first
  (waiting 0 :type sb-ext:word)
  (octets 0 :type sb-ext:word)
  (dropped 0 :type sb-ext:word)
  (max-lines *answer-log-max-lines* :type fixnum :read-only t)
  (max-octets *answer-log-max-octets* :type fixnum :read-only t)
  (writing nil))

(defun clf-escaped (string)
  "STRING (octets as characters) escaped as nginx's combined format escapes
a field (\\xHH for a quote, a backslash, and octets below 32 or above 126)."
  (with-output-to-string (out)
    (loop for char across string
          for code = (char-code char)
          do (if (and (<= 32 code 126) (/= code 34) (/= code 92))
                 (write-char char out)
                 (format out "\\x~2,'0X" (logand code 255))))))

(defun hunchentoot-layout-line (address user request status bytes referer agent)
  "A line in the layout of Hunchentoot's own (its local ISO time, no
X-Forwarded-For) for an answer the engine wrote: REQUEST the request line
as received (or NIL), every field from the client escaped as
CLF-ESCAPED does."
  (multiple-value-bind (second minute hour date month year) (decode-universal-time (get-universal-time))
    (format nil "~A ~:[-~;~:*~A~] [~4,'0D-~2,'0D-~2,'0D ~2,'0D:~2,'0D:~2,'0D] \"~:[-~;~:*~A~]\" ~D ~D ~
                 \"~:[-~;~:*~A~]\" \"~:[-~;~:*~A~]\"~%"
            address (and user (clf-escaped user)) year month date hour minute second
            (and request (clf-escaped request)) status bytes
            (and referer (clf-escaped referer)) (and agent (clf-escaped agent)))))

(defun engine-answer-line (log c status bytes buffer start end)
  "LOG's line, (OCTETS . LENGTH) with OCTETS exactly LENGTH long, for the
answer STATUS the engine wrote on C (see GALLOP.CORE:MAKE-ENGINE's
LOG-ANSWER): a head it had accepted (its body then failed) with its fields,
as any request's; else the request line as received, BUFFER[START,END)
\(BUFFER NIL: none).  NIL, and nothing made, when LOG has no room for it
at its longest."
  (let* ((acceptor (answer-log-acceptor log))
         (address (address-string (gallop.core:connection-remote-address c)))
         (request (gallop.core:connection-request c))
         (accepted (and buffer (gallop.core:connection-head-pending-p c)))
         (method (and accepted (gallop.core:request-method request)))
         (target (and accepted (latin1-string buffer (gallop.core:request-target-start request)
                                              (gallop.core:request-target-end request))))
         (protocol (and accepted (if (zerop (gallop.core:request-minor request)) :http/1.0 :http/1.1)))
         (line (and buffer (latin1-string buffer start end))))
    (multiple-value-bind (agent referer authorization)
        (if accepted (head-log-fields buffer request) (values nil nil nil))
      (let* ((user (and authorization (basic-auth-user authorization)))
             (uri (if accepted target line))
             ;; At its longest in either layout: Hunchentoot's escapes no
             ;; more (four octets a character) and its fixed parts are
             ;; shorter.
             (size (log-line-size address user method uri protocol referer agent)))
        (when (reserve-answer-octets log size)
          (let ((made nil))
            (unwind-protect (setf made (make-answer-entry acceptor size address user method uri
                                                          protocol status bytes referer agent
                                                          line))
              ;; Counted at its length from now on; not at all if unmade.
              (sb-ext:atomic-decf (answer-log-octets log)
                                  (if made (- size (the fixnum (cdr made))) size)))))))))

(defun make-answer-entry (acceptor size address user method uri protocol status bytes
                          referer agent line)
  "ACCEPTOR's line of these fields (see ENGINE-ANSWER-LINE), SIZE octets
at most: (OCTETS . LENGTH), OCTETS exactly LENGTH long."
  (multiple-value-bind (octets length)
      (if (eq (acceptor-access-log-format acceptor) :combined)
          (multiple-value-bind (made length)
              (fill-log-line (make-array size :element-type '(unsigned-byte 8))
                             :combined address user method uri protocol status bytes
                             referer agent)
            (values (subseq made 0 length) length))
          (let ((text (hunchentoot-layout-line address user line status bytes referer agent)))
            (values (map '(simple-array (unsigned-byte 8) (*)) #'char-code text)
                    (length text))))
    (cons octets length)))

(defun reserve-answer-octets (log size)
  "Count SIZE octets on LOG; NIL, counting nothing, when it holds its most."
  (declare (type fixnum size))
  (let ((before (sb-ext:atomic-incf (answer-log-octets log) size)))
    (or (< before (answer-log-max-octets log))
        (progn (sb-ext:atomic-decf (answer-log-octets log) size)
               nil))))

(defun log-answer-line (tm acceptor c status bytes buffer start end)
  "GALLOP.CORE:MAKE-ENGINE's LOG-ANSWER for TM's ACCEPTOR: the line of the
answer STATUS the engine wrote on C, made now (C's buffers go back to the
pool next) if TM's ANSWER-LOG has room for it, and left to its writer (see
the file's header).  Never waits: any thread may call it, the housekeeper
included."
  (let ((log (taskmaster-answer-log tm)))
    (when (and log (hunchentoot:acceptor-access-log-destination acceptor))
      ;; A slot first: a line is made only when it can be kept.
      ;; ATOMIC-INCF returns the count before.
      (if (>= (sb-ext:atomic-incf (answer-log-waiting log)) (answer-log-max-lines log))
          (drop-answer-lines log 1)
          (let ((entry (handler-case (engine-answer-line log c status bytes buffer start end)
                         (error () nil))))
            (cond ((null entry) (drop-answer-lines log 1))
                  (t (sb-ext:atomic-push entry (answer-log-lines log))
                     (start-answer-writer log))))))))

(defun drop-answer-lines (log n &optional (octets 0))
  "N lines of LOG, holding OCTETS, leave it unwritten: counted as dropped."
  (sb-ext:atomic-decf (answer-log-octets log) octets)
  (sb-ext:atomic-decf (answer-log-waiting log) n)
  (sb-ext:atomic-incf (answer-log-dropped log) n))

(defun start-answer-writer (log)
  "Hand LOG's writer to the pool unless it is there already.  If the pool
refuses it, the lines wait for the next line's writer, or the stop's
\(FINISH-ANSWER-LOG)."
  (when (null (sb-ext:compare-and-swap (answer-log-writing log) nil t))
    (handler-case (funcall (answer-log-submit log) (lambda () (run-answer-writer log)))
      (error ()
        (setf (answer-log-writing log) nil)))))

(defun run-answer-writer (log)
  "In a worker: write what LOG holds, in batches, until it holds nothing."
  (loop
    (write-answer-lines log)
    ;; Then let go, and look again: a line pushed after the batch was
    ;; taken, while this writer still counted as running, started none.
    (setf (answer-log-writing log) nil)
    (sb-thread:barrier (:memory))
    (unless (and (answer-log-lines log)
                 (null (sb-ext:compare-and-swap (answer-log-writing log) nil t)))
      (return))))

(defun write-answer-lines (log)
  "Take every line LOG holds and write them, oldest first, with one open of
the destination under Hunchentoot's lock; lines that cannot be written
\(no destination, an error) are counted as dropped."
  (let ((lines (loop for old = (answer-log-lines log)
                     until (eq old (sb-ext:compare-and-swap (answer-log-lines log) old '()))
                     finally (return (nreverse old)))))
    (when lines
      (let ((n (length lines))
            (octets (loop for entry in lines sum (the fixnum (cdr entry))))
            (destination (hunchentoot:acceptor-access-log-destination (answer-log-acceptor log))))
        (if (and destination
                 (handler-case (progn (write-access-lines destination lines) t)
                   (error () nil)))
            (progn (sb-ext:atomic-decf (answer-log-octets log) octets)
                   (sb-ext:atomic-decf (answer-log-waiting log) n))
            (drop-answer-lines log n octets))))))

(defun finish-answer-log (log)
  "Write what LOG still holds, once its engine stopped (no thread adds to it
then): lines whose writer the pool never ran, or refused."
  (write-answer-lines log))
