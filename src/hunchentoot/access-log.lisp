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
;;;; LOG-ANSWER-LINE, which writes a line for each, on any acceptor it
;;;; serves, in the acceptor's format (for :HUNCHENTOOT, and a stock
;;;; acceptor, Hunchentoot's layout with the request line as received,
;;;; escaped).  A worker writes it as it writes any line; the housekeeper
;;;; (a 408, a 503 when overloaded) must never wait on a disk, so it hands
;;;; the line to the pool, at most +WAITING-LINES+ at once: past them lines
;;;; are dropped, and counted (GALLOP:STATS :ACCESS-LOG-DROPPED).

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
destination, as Hunchentoot writes its lines: under its lock, a pathname
opened for each line (a file logrotate moved is left at once), a stream
written and finished."
  (bt:with-lock-held ((hunchentoot-access-log-lock))
    (etypecase destination
      ((or string pathname)
       (with-open-file (out destination :direction :output :element-type '(unsigned-byte 8)
                                        :if-exists :append :if-does-not-exist :create)
         (write-sequence line out :end length)))
      (stream
       (if (subtypep (stream-element-type destination) 'character)
           (write-string (map 'string #'code-char (subseq line 0 length)) destination)
           (write-sequence line destination :end length))
       (finish-output destination)))))

;;; The engine's own answers

(defconstant +waiting-lines+ 1024
  "Lines of the engine's own answers a taskmaster's housekeeper may have
handed to the pool, not written yet; past them, lines are dropped.")

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

(defun engine-answer-line (acceptor c status bytes buffer start end)
  "ACCEPTOR's line (octets, and its length) for the answer STATUS the
engine wrote on C (see GALLOP.CORE:MAKE-ENGINE's LOG-ANSWER): a head it had
accepted (its body then failed) with its fields, as any request's; else
the request line as received, BUFFER[START,END) (BUFFER NIL: none)."
  (let* ((address (address-string (gallop.core:connection-remote-address c)))
         (request (gallop.core:connection-request c))
         (accepted (and buffer (gallop.core:connection-head-pending-p c)))
         (method (and accepted (gallop.core:request-method request)))
         (target (and accepted (latin1-string buffer (gallop.core:request-target-start request)
                                              (gallop.core:request-target-end request))))
         (protocol (and accepted (if (zerop (gallop.core:request-minor request)) :http/1.0 :http/1.1)))
         (line (and buffer (latin1-string buffer start end))))
    (multiple-value-bind (agent referer authorization)
        (if accepted (head-log-fields buffer request) (values nil nil nil))
      (let ((user (and authorization (basic-auth-user authorization))))
        (if (eq (acceptor-access-log-format acceptor) :combined)
            (fill-log-line (make-array (log-line-size address user method (if accepted target line)
                                                      protocol referer agent)
                                       :element-type '(unsigned-byte 8))
                           :combined address user method (if accepted target line) protocol
                           status bytes referer agent)
            (let ((text (hunchentoot-layout-line address user line status bytes referer agent)))
              (values (map '(simple-array (unsigned-byte 8) (*)) #'char-code text)
                      (length text))))))))

(defun log-answer-line (tm acceptor c status bytes buffer start end)
  "GALLOP.CORE:MAKE-ENGINE's LOG-ANSWER for TM's ACCEPTOR: the line of the
answer STATUS the engine wrote on C, made now (C's buffers go back to the
pool next), written here in a worker, else by a worker of the pool (see
the file's header)."
  (let ((destination (hunchentoot:acceptor-access-log-destination acceptor))
        (counts (taskmaster-log-counts tm)))
    (when destination
      (handler-case
          (multiple-value-bind (line length) (engine-answer-line acceptor c status bytes
                                                                 buffer start end)
            (flet ((write-it ()
                     (handler-case (write-access-line destination line length)
                       (error () (sb-ext:atomic-incf (aref counts 1))))))
              (cond (gallop.core:*worker-locals* (write-it))
                    ;; ATOMIC-INCF returns the count before.
                    ((< (sb-ext:atomic-incf (aref counts 0)) +waiting-lines+)
                     (gallop.core:pool-submit (gallop.core:engine-pool
                                               (gallop.core:connection-engine c))
                                              (lambda ()
                                                (unwind-protect (write-it)
                                                  (sb-ext:atomic-decf (aref counts 0))))))
                    (t (sb-ext:atomic-decf (aref counts 0))
                       (sb-ext:atomic-incf (aref counts 1))))))
        (error () (sb-ext:atomic-incf (aref counts 1)))))))
